"""Retention: chunks requests keep asking for are put soft-pinned, within a byte budget that lapses."""

from dataclasses import replace

import pytest
import torch

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.pipeline.testing import batch_of
from kvpipe.stages import Buffer, Code, PutStage, StoreObject
from kvpipe.stages.retention import LoadedKeys, PinBudget, ReuseCounter

from .clock import Clock
from .save_path import put_params
from .stores import RecordingStore, ScriptedStore, fake_record

HOT = b"\x01" * 16
COLD = b"\x02" * 16


# -- which chunks are reused ---------------------------------------------------------------


def test_a_chunk_one_request_asked_for_is_not_reused():
    counter = ReuseCounter(min_requests=2)

    counter.asked([HOT, COLD])

    assert counter.reused([HOT, COLD]) == {}


def test_a_chunk_two_requests_asked_for_is_reused():
    counter = ReuseCounter(min_requests=2)

    counter.asked([HOT, COLD])
    counter.asked([HOT])

    assert counter.reused([HOT, COLD]) == {HOT: 2}


def test_a_request_naming_a_chunk_twice_counts_once():
    counter = ReuseCounter(min_requests=2)

    counter.asked([HOT, HOT])

    assert counter.requests(HOT) == 1


def test_the_least_recently_asked_chunks_are_forgotten_past_the_bound():
    counter = ReuseCounter(min_requests=2, remembered=2)
    counter.asked([HOT])
    counter.asked([COLD])

    counter.asked([b"\x03" * 16])

    assert counter.requests(HOT) == 0
    assert counter.requests(COLD) == 1


def test_asking_again_keeps_a_chunk_remembered():
    counter = ReuseCounter(min_requests=2, remembered=2)
    counter.asked([HOT])
    counter.asked([COLD])
    counter.asked([HOT])

    counter.asked([b"\x03" * 16])

    assert counter.requests(HOT) == 2
    assert counter.requests(COLD) == 0


@pytest.mark.parametrize("field, value", [("min_requests", 0), ("remembered", 0)])
def test_a_counter_below_one_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got {value}"):
        ReuseCounter(**{field: value})


# -- the pin budget ------------------------------------------------------------------------


def test_pins_within_the_budget_are_taken():
    budget = PinBudget(max_bytes=100, ttl_s=10, clock=Clock())

    assert budget.admit("a", 60, reuse=2) == (True, [])
    assert budget.admit("b", 40, reuse=2) == (True, [])
    assert budget.held_bytes == 100


def test_a_pin_past_the_budget_is_refused_when_every_held_pin_is_asked_for_as_often():
    budget = PinBudget(max_bytes=100, ttl_s=10, clock=Clock())
    budget.admit("a", 60, reuse=3)

    assert budget.admit("b", 41, reuse=3) == (False, [])
    assert budget.held_bytes == 60


def test_a_more_requested_chunk_demotes_the_least_requested_pins_that_make_room():
    budget = PinBudget(max_bytes=100, ttl_s=10, clock=Clock())
    budget.admit("warm", 50, reuse=3)
    budget.admit("cool", 50, reuse=2)

    assert budget.admit("hot", 50, reuse=9) == (True, ["cool"])
    assert budget.held_bytes == 100


def test_no_pin_is_demoted_when_demoting_all_the_less_requested_would_not_make_room():
    budget = PinBudget(max_bytes=100, ttl_s=10, clock=Clock())
    budget.admit("cool", 40, reuse=2)
    budget.admit("warm", 60, reuse=9)

    assert budget.admit("hot", 50, reuse=5) == (False, [])
    assert budget.admit("hotter", 40, reuse=5) == (True, ["cool"])


def test_a_key_pinned_again_replaces_its_earlier_pin():
    budget = PinBudget(max_bytes=100, ttl_s=10, clock=Clock())
    budget.admit("a", 60, reuse=2)

    assert budget.admit("a", 60, reuse=4) == (True, [])
    assert budget.held_bytes == 60


def test_a_lapsed_pin_gives_its_bytes_back():
    clock = Clock()
    budget = PinBudget(max_bytes=100, ttl_s=10, clock=clock)
    budget.admit("a", 100, reuse=9)

    clock.now = 10.0

    assert budget.held_bytes == 0
    assert budget.admit("b", 100, reuse=2) == (True, [])


def test_a_pin_holds_its_bytes_until_its_ttl():
    clock = Clock()
    budget = PinBudget(max_bytes=100, ttl_s=10, clock=clock)
    budget.admit("a", 100, reuse=2)

    clock.now = 9.999

    assert budget.admit("b", 1, reuse=2) == (False, [])


def test_a_lapsed_pin_is_never_demoted():
    clock = Clock()
    budget = PinBudget(max_bytes=100, ttl_s=10, clock=clock)
    budget.admit("old", 100, reuse=2)
    clock.now = 10.0

    assert budget.admit("new", 100, reuse=2) == (True, [])
    assert budget.admit("newer", 100, reuse=3) == (True, ["new"])


def test_each_load_of_a_pinned_object_counts_as_one_more_request_for_its_chunk():
    loads = LoadedKeys()
    clock = Clock()
    budget = PinBudget(max_bytes=100, ttl_s=10, clock=clock, loads=loads)
    budget.admit("early", 50, reuse=2)  # pinned at its second request: the first to lapse, and to demote
    clock.now = 1.0
    budget.admit("cool", 50, reuse=2)

    loads.loaded(["early", "early", "unpinned"])  # two more requests hit it

    assert budget.admit("newcomer", 50, reuse=3) == (True, ["cool"])


def test_a_pin_loaded_as_often_as_a_newcomer_asked_keeps_its_place():
    loads = LoadedKeys()
    budget = PinBudget(max_bytes=50, ttl_s=10, clock=Clock(), loads=loads)
    budget.admit("early", 50, reuse=2)

    loads.loaded(["early"])

    assert budget.admit("newcomer", 50, reuse=3) == (False, [])


def test_loaded_keys_are_taken_once_oldest_first():
    loads = LoadedKeys()
    loads.loaded(["a", "b"])
    loads.loaded(["c"])

    assert loads.take() == ["a", "b", "c"]
    assert loads.take() == []


def test_loaded_keys_nobody_takes_are_dropped_oldest_first_past_the_bound():
    loads = LoadedKeys(remembered=2)

    loads.loaded(["a", "b", "c"])

    assert loads.take() == ["b", "c"]


def test_the_ttl_is_given_to_the_store_in_milliseconds():
    assert PinBudget(max_bytes=1, ttl_s=2.5).ttl_ms == 2500


@pytest.mark.parametrize("kwargs, message", [({"max_bytes": -1}, "max_bytes"), ({"ttl_s": 0}, "ttl_s")])
def test_a_bad_budget_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PinBudget(**{"max_bytes": 1, "ttl_s": 1.0, **kwargs})


# -- the put stage -------------------------------------------------------------------------


_MEMORY = torch.zeros(64, dtype=torch.uint8)  # the bytes of every object a store copies or a seal sums


def _record(key: str, reuse: int = 0) -> StoreObject:
    return replace(fake_record(key, reuse=reuse), buffers=(Buffer(_MEMORY.data_ptr(), 64),))


def _put_stage(store, **params) -> PutStage:
    return PutStage(put_params(**params), store)


def _pin_ttl_of(store: RecordingStore) -> dict[str, int | None]:
    """Each object key put (seals left out) -> the soft-pin TTL of its call."""
    return {
        key: call.config.soft_pin_ttl_ms
        for call in store.put_calls
        for key in call.keys
        if not key.endswith("@kvpipe-seal")
    }


async def test_marked_records_are_put_soft_pinned_with_the_ttl_and_the_rest_unpinned():
    store = RecordingStore(ScriptedStore())
    batch = batch_of([(fake_record("hot", reuse=2), fake_record("cold"))])

    await _put_stage(store, max_pinned_bytes=1 << 20, soft_pin_ttl_s=30).process_batch(batch)

    assert _pin_ttl_of(store) == {"hot": 30_000, "cold": None}
    assert batch[0].emit.counts["pinned"] == 1
    assert batch[0].emit.counts["put"] == 2


async def test_a_seal_is_pinned_with_its_object():
    store = RecordingStore(ScriptedStore())
    stage = PutStage(put_params(max_pinned_bytes=1 << 20), store, fingerprint=b"f" * 16)

    await stage.process_batch(batch_of([(_record("hot", reuse=2),)]))

    (call,) = store.put_calls
    assert call.keys == ["hot", "hot@kvpipe-seal"]
    assert call.config.soft_pin_ttl_ms == 600_000


async def test_a_marked_record_past_the_budget_is_put_unpinned():
    store = RecordingStore(ScriptedStore())
    records = (fake_record("a", reuse=2), fake_record("b", reuse=2))  # 64 bytes each

    await _put_stage(store, max_pinned_bytes=64).process_batch(batch := batch_of([records]))

    assert sorted(_pin_ttl_of(store).values(), key=str) == [600_000, None]
    assert batch[0].emit.counts["put"] == 2


async def test_a_demoted_pin_is_removed_from_the_store_before_the_put_that_takes_its_place():
    store = RecordingStore(ScriptedStore())
    stage = _put_stage(store, max_pinned_bytes=64)
    await stage.process_batch(batch_of([(fake_record("cool", reuse=2),)]))

    await stage.process_batch(batch_of([(fake_record("hot", reuse=5),)]))

    assert store.inner.removed == ["cool"]
    assert _pin_ttl_of(store)["hot"] == 600_000


async def test_no_budget_pins_nothing():
    store = RecordingStore(ScriptedStore())

    await _put_stage(store).process_batch(batch_of([(fake_record("hot", reuse=2),)]))

    assert _pin_ttl_of(store) == {"hot": None}


async def test_pinned_objects_are_evicted_after_every_unpinned_one():
    store = MemoryStore(10 * 64, high_watermark=1.0, eviction_ratio=0.1, lease_ttl_s=0)
    stage = _put_stage(store, max_pinned_bytes=1 << 20, seal=False)
    await stage.process_batch(batch_of([tuple(_record(f"hot{i}", reuse=2) for i in range(3))]))

    for i in range(20):  # a flood of one-off objects, twice the store
        await stage.process_batch(batch_of([(_record(f"cold{i}"),)]))

    assert store.batch_is_exist(["hot0", "hot1", "hot2"]) == [1, 1, 1]
    assert store.batch_is_exist(["cold0"]) == [0]


@pytest.mark.parametrize("code", [Code.NO_SPACE, Code.ALREADY_EXISTS], ids=["no-space", "already-there"])
async def test_a_pin_whose_put_did_not_store_its_object_holds_no_budget(code: int):
    """The next chunk may take the budget: a failed or redundant put pinned nothing."""
    store = RecordingStore(ScriptedStore(put=lambda key: code if key == "first" else 0))
    stage = _put_stage(store, max_pinned_bytes=64, seal=False, space_wait_s=0)
    await stage.process_batch(batch_of([(fake_record("first", reuse=2),)]))

    await stage.process_batch(batch_of([(fake_record("second", reuse=2),)]))

    assert _pin_ttl_of(store)["second"] == 600_000
    assert store.inner.removed == []  # nothing to demote: "first" holds no pin
