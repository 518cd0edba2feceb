"""MemoryStore's own promises, beyond the store contract.

Fault injection, the older-Mooncake switch, thread safety, argument
validation and stats exist only in the model; eviction order and exact lease
ends need its fake clock. Contract behaviour is tested in test_store_contract.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvpipe.connector.store import memory as memory_module
from kvpipe.connector.store.memory import Faults, MemoryReplicateConfig, MemoryStore, StoreStats
from kvpipe.stages.store import Code

from ..conftest import Kv


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def memory_kv(capacity_bytes: int = 1 << 20, **kwargs: object) -> Kv:
    return Kv(MemoryStore(capacity_bytes, **kwargs))  # type: ignore[arg-type]


def objects(*keys: str, size: int = 100) -> dict[str, bytes]:
    return {key: key.encode().ljust(size, b".") for key in keys}


# -- construction --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": 1.5}, "capacity_bytes"),
        ({"capacity_bytes": True}, "capacity_bytes"),
        ({"high_watermark": 0.0}, "high_watermark"),
        ({"high_watermark": 1.5}, "high_watermark"),
        ({"eviction_ratio": -0.1}, "eviction_ratio"),
        ({"eviction_ratio": 2.0}, "eviction_ratio"),
        ({"lease_ttl_s": -1.0}, "lease_ttl_s"),
        ({"lease_ttl_s": float("nan")}, "lease_ttl_s"),
        ({"faults": {"outage": "down"}}, "faults"),
        ({"clock": 0.0}, "clock"),
    ],
)
def test_bad_constructor_arguments_name_the_argument_and_value(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named) as caught:
        MemoryStore(**kwargs)  # type: ignore[arg-type]
    assert repr(next(iter(kwargs.values()))) in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"error_rates": {"write": {-800: 0.1}}}, "op must be one of"),
        ({"error_rates": {"put": {800: 0.1}}}, "codes must be negative"),
        ({"error_rates": {"put": {-800: 1.5}}}, r"error_rates\['put'\]\[-800\]"),
        ({"error_rates": {"put": {-800: 0.6, -900: 0.6}}}, "sum to more than 1"),
        ({"latency_s": {"get": -1.0}}, r"latency_s\['get'\]"),
        ({"outage": "sideways"}, "outage"),
        ({"stall_s": -1.0}, "stall_s"),
    ],
)
def test_bad_faults_name_the_field_and_value(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Faults(**kwargs)  # type: ignore[arg-type]


# -- fault injection -----------------------------------------------------------------------


def test_a_put_fault_returns_its_code_and_stores_nothing() -> None:
    kv = memory_kv(faults=Faults(error_rates={"put": {-800: 1.0}}))
    assert kv.put(objects("a", "b")) == [Code.TRANSFER_FAILED] * 2
    kv.store.faults = Faults()
    assert kv.exists("a", "b") == [0, 0]


@pytest.mark.parametrize("op", ["exist", "get"])
def test_exist_and_get_faults_return_their_code(op: str) -> None:
    kv = memory_kv()
    kv.put(objects("a"))
    kv.store.faults = Faults(error_rates={op: {-901: 1.0}})
    result = kv.exists("a")[0] if op == "exist" else kv.get("a", 100)
    assert result == Code.RPC_TIMEOUT


def test_fault_rates_apply_per_key() -> None:
    kv = memory_kv(faults=Faults(error_rates={"exist": {-900: 0.2, -901: 0.05}}, seed=1))
    codes = kv.exists(*(f"k{i}" for i in range(4000)))
    assert 700 < codes.count(-900) < 900
    assert 140 < codes.count(-901) < 260
    assert codes.count(0) == 4000 - codes.count(-900) - codes.count(-901)


def test_the_same_seed_draws_the_same_faults() -> None:
    def draws() -> list[int]:
        return memory_kv(faults=Faults(error_rates={"exist": {-900: 0.5}}, seed=7)).exists(
            *(f"k{i}" for i in range(100))
        )

    assert draws() == draws()


def test_injected_latency_is_slept_outside_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call sleeping its latency leaves the store to the others, as a slow network would."""
    kv = memory_kv(faults=Faults(latency_s={"exist": 60.0}))
    sleeping, wake = threading.Event(), threading.Event()

    def sleep(seconds: float) -> None:  # the latency's sleep, held until the test lets it go
        sleeping.set()
        wake.wait(seconds)

    monkeypatch.setattr(memory_module.time, "sleep", sleep)
    slow = threading.Thread(target=kv.exists, args=("k",))
    slow.start()
    try:
        assert sleeping.wait(30)
        put = threading.Thread(target=kv.put, args=({"other": b"v"},))
        put.start()
        put.join(30)  # a lock held through the sleep would hold the put until the latency ends
        assert not put.is_alive() and slow.is_alive()
    finally:
        wake.set()
        slow.join()


def test_a_down_store_fails_every_key_of_every_call_with_900_at_once() -> None:
    kv = memory_kv()
    src, dst = kv.buffer(b"v"), kv.buffer(1)
    kv.store.faults = Faults(outage="down")
    started = time.monotonic()
    config = kv.store.new_replicate_config()
    assert kv.store.batch_is_exist(["a", "b"]) == [Code.RPC_FAILED] * 2
    assert kv.store.batch_put_from(["a", "b"], [src, src], [1, 1], config) == [Code.RPC_FAILED] * 2
    assert kv.store.batch_get_into(["a"], [dst], [1]) == [Code.RPC_FAILED]
    assert [kv.store.get_size("a"), kv.store.remove("a"), kv.store.remove_all()] == [Code.RPC_FAILED] * 3
    assert time.monotonic() - started < 1.0  # no stall (a stalled store waits stall_s per call)


def test_a_stalled_store_answers_901_after_stall_s() -> None:
    kv = memory_kv(faults=Faults(outage="stalled", stall_s=0.1))
    started = time.monotonic()
    assert kv.exists("a", "b") == [Code.RPC_TIMEOUT] * 2
    assert kv.store.get_size("a") == Code.RPC_TIMEOUT
    assert time.monotonic() - started >= 0.2


def test_an_outage_can_start_and_end_mid_run_and_keeps_the_objects() -> None:
    kv = memory_kv()
    kv.put(objects("a"))
    kv.store.faults = Faults(outage="down")
    assert kv.exists("a") == [Code.RPC_FAILED]
    kv.store.faults = Faults()
    assert kv.exists("a") == [1]


# -- an older Mooncake ---------------------------------------------------------------------


def test_without_group_ids_the_config_has_no_such_attribute() -> None:
    store = MemoryStore(group_ids_supported=False)
    config = store.new_replicate_config()
    assert not store.supports_group_ids
    assert not hasattr(config, "group_ids")
    with pytest.raises(AttributeError):
        config.group_ids = ["g"]  # type: ignore[attr-defined]


def test_without_group_ids_puts_still_work() -> None:
    kv = Kv(MemoryStore(group_ids_supported=False))
    assert kv.put(objects("a")) == [0]
    assert kv.get("a", 100) == objects("a")["a"]


@pytest.mark.parametrize("group_ids_supported", [True, False])
def test_a_config_not_made_by_the_store_is_a_type_error(group_ids_supported: bool) -> None:
    kv = Kv(MemoryStore(group_ids_supported=group_ids_supported))
    src = kv.buffer(b"v")
    foreign = MemoryReplicateConfig() if not group_ids_supported else object()
    with pytest.raises(TypeError, match="new_replicate_config"):
        kv.store.batch_put_from(["a"], [src], [1], foreign)


def test_group_ids_take_any_sequence_of_str_but_not_a_str() -> None:
    config = MemoryReplicateConfig()
    config.group_ids = ("a", "b")
    assert config.group_ids == ["a", "b"]
    with pytest.raises(TypeError):
        config.group_ids = "ab"


# -- threads -------------------------------------------------------------------------------


def test_concurrent_callers_keep_every_object_intact() -> None:
    kv = memory_kv(capacity_bytes=64 * 1024, lease_ttl_s=0.0)  # small and unleased: threads race evictions
    values = objects(*(f"k{i}" for i in range(300)), size=1024)
    wrong: list[str] = []

    def worker(offset: int) -> None:
        keys = list(values)[offset:] + list(values)[:offset]
        for i in range(0, len(keys), 10):
            batch = keys[i : i + 10]
            kv.put({k: values[k] for k in batch})
            kv.exists(*batch)
            for k in batch[:3]:
                got = kv.get(k, 1024)
                if got != Code.NOT_FOUND and got != values[k]:
                    wrong.append(k)

    threads = [threading.Thread(target=worker, args=(n * 37,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    stats = kv.store.stats()
    sizes = [kv.store.get_size(k) for k in values]
    assert stats.bytes_used == sum(s for s in sizes if s > 0) <= 64 * 1024
    assert stats.evicted_objects > 0


# -- stats ---------------------------------------------------------------------------------


def test_stats_count_objects_groups_bytes_and_evictions() -> None:
    kv = memory_kv(capacity_bytes=1000, high_watermark=1.0, eviction_ratio=0.0)
    kv.put(objects("c", *(f"k{i}" for i in range(7))))
    kv.put(objects("a", "b"), group_ids=["g", "g"])
    kv.put(objects("k7"))  # full: evicts "c"
    assert kv.store.stats() == StoreStats(
        objects=10, groups=1, bytes_used=1000, capacity_bytes=1000, evicted_objects=1, evicted_bytes=100
    )


# -- eviction and leases, on a fake clock --------------------------------------------------


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ten_slots(clock: FakeClock) -> Kv:
    """A store of ten 100-byte objects that evicts only what a put needs."""
    return memory_kv(1000, high_watermark=1.0, eviction_ratio=0.0, lease_ttl_s=5.0, clock=clock)


def test_eviction_takes_the_least_recently_used_first(ten_slots: Kv, clock: FakeClock) -> None:
    kv = ten_slots
    kv.put(objects(*"abcdefghij"))
    kv.store.get_size("a")  # "a" is now the most recently used...
    clock.now = 10.0  # ...and its lease is over
    kv.put(objects("k"))
    assert kv.exists(*"abck") == [1, 0, 1, 1]


def test_eviction_skips_leased_objects(ten_slots: Kv) -> None:
    kv = ten_slots
    kv.put(objects(*"abcdefghij"))
    kv.store.get_size("a")
    kv.put(objects("k"))
    assert kv.exists(*"abk") == [1, 0, 1]


def test_a_lease_lasts_exactly_lease_ttl_s(ten_slots: Kv, clock: FakeClock) -> None:
    kv = ten_slots
    kv.put(objects("a"))
    kv.exists("a")
    clock.now = 4.999
    assert kv.store.remove("a") == Code.HAS_LEASE
    clock.now = 5.0
    assert kv.store.remove("a") == 0


def test_eviction_frees_at_least_the_eviction_ratio(clock: FakeClock) -> None:
    kv = memory_kv(1000, high_watermark=1.0, eviction_ratio=0.3, clock=clock)
    kv.put(objects(*"abcdefghij"))
    kv.put(objects("k"))
    assert kv.exists(*"abcdk") == [0, 0, 0, 1, 1]
    assert kv.store.stats().evicted_bytes == 300


def test_crossing_the_high_watermark_evicts_before_the_store_is_full(clock: FakeClock) -> None:
    kv = memory_kv(1000, high_watermark=0.5, eviction_ratio=0.0, clock=clock)
    kv.put(objects(*"abcde"))
    kv.put(objects("f"))
    assert kv.store.stats().objects == 5
    assert kv.exists("a") == [0]


def test_whole_group_eviction_can_free_far_more_than_asked(ten_slots: Kv) -> None:
    kv = ten_slots
    kv.put(objects(*"abcde"), group_ids=["g"] * 5)
    kv.put(objects(*"fghij"))
    kv.put(objects("k"))
    assert kv.store.stats().evicted_objects == 5
    assert kv.exists(*"aefk") == [0, 0, 1, 1]


def test_a_group_is_kept_while_any_member_is_leased(ten_slots: Kv) -> None:
    kv = ten_slots
    kv.put(objects("a"), group_ids=["g"])
    kv.store.get_size("a")
    kv.put(objects("b"), group_ids=["g"])  # joins after the read: itself unleased
    kv.put(objects(*"cdefghij"))
    kv.put(objects("k"))
    assert kv.exists(*"abck") == [1, 1, 0, 1]


def test_a_put_never_evicts_what_it_stored_itself(clock: FakeClock) -> None:
    kv = memory_kv(300, high_watermark=1.0, eviction_ratio=0.0, clock=clock)
    assert kv.put(objects(*"abcd")) == [0, 0, 0, Code.NO_SPACE]
    assert kv.exists(*"abcd") == [1, 1, 1, 0]


# -- close ---------------------------------------------------------------------------------


def test_a_closed_store_refuses_buffer_registration_too() -> None:
    store = MemoryStore()
    store.close()
    assert store.register_buffer(4096, 64) == Code.RPC_FAILED
    assert store.unregister_buffer(4096) == Code.RPC_FAILED
