"""The circuit breaker: fail fast while the master is gone, probe, and close when it is back."""

import anyio
import pytest

from kvpipe.connector.store.breaker import BreakerSettings, BreakerState, CircuitBreaker, GuardedStore
from kvpipe.connector.store.configs import MemoryStoreConfig, MooncakeStoreConfig, open_store
from kvpipe.connector.store.memory import Faults, MemoryStore
from kvpipe.pipeline import Pipeline
from kvpipe.stages import default_save_graph

from ...stages.kv_fixtures import make_kv, make_request

KEYS = ["a", "b", "c"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingStore(MemoryStore):
    """The memory model, counting the exist calls that reach it."""

    calls = 0

    def batch_is_exist(self, keys):
        self.calls += 1
        return super().batch_is_exist(keys)


def _guarded(outage="none", failures_to_open=3, open_s=1.0, stall_s=0.0):
    clock = FakeClock()
    store = CountingStore(faults=Faults(outage=outage, stall_s=stall_s))
    breaker = CircuitBreaker(BreakerSettings(failures_to_open=failures_to_open, open_s=open_s), clock=clock)
    return GuardedStore(store, breaker), store, clock


def test_calls_go_through_while_the_master_answers():
    guarded, store, _ = _guarded()
    assert guarded.batch_is_exist(KEYS) == [0, 0, 0]
    assert (store.calls, guarded.breaker.state) == (1, BreakerState.CLOSED)


def test_consecutive_master_failures_open_it_and_calls_then_fail_fast_without_the_store():
    guarded, store, _ = _guarded(outage="down", failures_to_open=3)
    for _ in range(3):
        assert guarded.batch_is_exist(KEYS) == [-900] * 3
    assert guarded.breaker.state is BreakerState.OPEN
    assert guarded.batch_is_exist(KEYS) == [-900] * 3
    assert store.calls == 3 and guarded.breaker.refused == 1


def test_a_stalled_master_costs_one_timeout_per_call_only_until_the_breaker_opens():
    guarded, store, _ = _guarded(outage="stalled", failures_to_open=2, stall_s=0.05)
    guarded.batch_is_exist(KEYS)
    guarded.batch_is_exist(KEYS)
    assert store.calls == 2  # each of them waited out the stall in the store
    assert guarded.batch_is_exist(KEYS) == [-900] * 3
    # refused by the breaker, never reaching the store: no stall to wait out
    assert (store.calls, guarded.breaker.refused) == (2, 1)


def test_an_answer_between_failures_starts_the_count_again():
    guarded, store, _ = _guarded(failures_to_open=2)
    store.faults = Faults(outage="down")
    guarded.batch_is_exist(KEYS)
    store.faults = Faults()
    guarded.batch_is_exist(KEYS)
    store.faults = Faults(outage="down")
    guarded.batch_is_exist(KEYS)
    assert guarded.breaker.state is BreakerState.CLOSED


def test_refusals_of_a_working_store_do_not_open_it():
    guarded, store, _ = _guarded(failures_to_open=1)
    store.faults = Faults(error_rates={"exist": {-800: 1.0}})
    for _ in range(5):
        assert guarded.batch_is_exist(KEYS) == [-800] * 3
    assert guarded.breaker.state is BreakerState.CLOSED


def test_after_open_s_one_probe_goes_through_and_an_answer_closes_it():
    guarded, store, clock = _guarded(outage="down", failures_to_open=1, open_s=1.0)
    guarded.batch_is_exist(KEYS)
    store.faults = Faults()  # the master is back
    clock.now = 0.5
    assert guarded.batch_is_exist(KEYS) == [-900] * 3  # still cooling down
    clock.now = 1.0
    assert guarded.breaker.state is BreakerState.HALF_OPEN
    assert guarded.batch_is_exist(KEYS) == [0, 0, 0]
    assert guarded.breaker.state is BreakerState.CLOSED


def test_a_failed_probe_keeps_it_open_for_another_open_s():
    guarded, store, clock = _guarded(outage="down", failures_to_open=1, open_s=1.0)
    guarded.batch_is_exist(KEYS)
    clock.now = 1.0
    guarded.batch_is_exist(KEYS)  # the probe: the master is still down
    calls = store.calls
    clock.now = 1.5
    assert guarded.batch_is_exist(KEYS) == [-900] * 3
    assert store.calls == calls
    assert guarded.breaker.opened == 1  # one outage, however many probes


def test_only_one_probe_is_in_flight_at_a_time():
    breaker = CircuitBreaker(BreakerSettings(failures_to_open=1, open_s=1.0), clock=(clock := FakeClock()))
    assert breaker.allow()
    breaker.record(master_trouble=True)
    clock.now = 2.0
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # others wait for its answer


def test_a_store_call_that_raises_counts_as_master_trouble_and_still_raises():
    class Raising(MemoryStore):
        def batch_is_exist(self, keys):
            raise RuntimeError("client gone")

    guarded = GuardedStore(Raising(), CircuitBreaker(BreakerSettings(failures_to_open=1)))
    with pytest.raises(RuntimeError):
        guarded.batch_is_exist(KEYS)
    assert guarded.breaker.state is BreakerState.OPEN


async def test_saves_fail_fast_while_the_master_is_down_and_store_again_once_it_is_back():
    fixture = make_kv(layers=2)
    inner = MemoryStore(faults=Faults(outage="down"))
    guarded = GuardedStore(inner, CircuitBreaker(BreakerSettings(failures_to_open=2, open_s=0.05)))
    async with Pipeline(default_save_graph(fixture.kv, guarded)) as pipeline:
        down = [await pipeline.submit(make_request(fixture.kv, 32, request_id=f"d{i}")) for i in range(5)]
        with anyio.fail_after(2):
            for job in down:
                await job.finished()
        assert all(job.counts["failed"] == 2 for job in down)
        inner.faults = Faults()
        await anyio.sleep(0.06)
        back = await pipeline.submit(make_request(fixture.kv, 32, request_id="back"))
        await back.finished()
    assert back.counts["put"] == 2 and guarded.breaker.state is BreakerState.CLOSED


def test_settings_name_a_bad_field():
    with pytest.raises(ValueError, match="failures_to_open"):
        BreakerSettings(failures_to_open=0)


def test_a_configured_store_opens_behind_a_breaker_unless_told_not_to():
    with open_store(MemoryStoreConfig()) as store:
        assert isinstance(store, GuardedStore)
        assert store.breaker.settings == BreakerSettings()
    with open_store(MemoryStoreConfig(breaker=None)) as store:
        assert isinstance(store, MemoryStore)


def test_the_breaker_is_kvpipes_setting_not_the_mooncake_clients(tmp_path):
    vllm_file = tmp_path / "mooncake.json"
    vllm_file.write_text(
        '{"metadata_server": "P2PHANDSHAKE", "master_server_address": "127.0.0.1:50051",'
        ' "global_segment_size": "64MB", "local_buffer_size": "16MB", "protocol": "tcp"}'
    )
    config = MooncakeStoreConfig.model_validate(
        {"vllm_config": str(vllm_file), "breaker": {"failures_to_open": 5}}
    )
    assert config.breaker == BreakerSettings(failures_to_open=5)
    assert "breaker" not in config.settings().model_dump()
