"""The slow-store throttle sheds puts while they are slow, probes, and resumes on a fast probe."""

import time

import pytest
from pydantic import ValidationError

from kvpipe.pipeline.testing import batch_of
from kvpipe.stages import PutParams, PutStage, SlowStoreThrottle, ThrottleParams

from .stores import RecordingStore, ScriptedStore, fake_record

PARAMS = ThrottleParams(
    slow_s=0.25, recovered_s=0.05, ema_weight=0.5, probe_every_s=0.5, min_bandwidth_mb_s=100
)
MB = 1_000_000


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _shedding_throttle(clock: _Clock) -> SlowStoreThrottle:
    throttle = SlowStoreThrottle(PARAMS, clock=clock)
    throttle.record(1.0, 0)
    assert throttle.shedding
    return throttle


def test_fast_puts_never_shed():
    throttle = SlowStoreThrottle(PARAMS)
    for _ in range(100):
        throttle.record(0.01, 64 << 10)

    assert not throttle.shedding and throttle.allow()


def test_one_hiccup_is_smoothed_but_slow_calls_in_a_row_start_shedding():
    throttle = SlowStoreThrottle(PARAMS)
    throttle.record(0.4, 0)  # average 0.2: under slow_s
    assert not throttle.shedding

    throttle.record(0.4, 0)  # average 0.3

    assert throttle.shedding and throttle.slow_spells == 1


def test_time_the_bytes_explain_is_not_slowness():
    throttle = SlowStoreThrottle(PARAMS)
    for _ in range(10):
        throttle.record(1.0, 100 * MB)  # 100 MB at the 100 MB/s floor: 1 s is expected

    assert not throttle.shedding and throttle.excess_s == 0


def test_while_shedding_one_probe_goes_through_per_probe_interval():
    clock = _Clock()
    throttle = _shedding_throttle(clock)

    allowed = []
    for _ in range(16):  # 2 s in steps of 1/8 s (exact in binary)
        clock.now += 0.125
        allowed.append(throttle.allow())

    assert [i for i, allow in enumerate(allowed) if allow] == [3, 7, 11, 15]


def test_a_slow_probe_keeps_shedding():
    clock = _Clock()
    throttle = _shedding_throttle(clock)
    clock.now += PARAMS.probe_every_s

    assert throttle.allow()
    throttle.record(0.2, 0)  # under slow_s, but not under recovered_s

    assert throttle.shedding and not throttle.allow()


def test_a_fast_probe_ends_shedding_and_restarts_the_average_from_it():
    clock = _Clock()
    throttle = _shedding_throttle(clock)
    clock.now += PARAMS.probe_every_s
    assert throttle.allow()

    throttle.record(0.01, 0)

    assert not throttle.shedding and throttle.excess_s == pytest.approx(0.01)
    assert all(throttle.allow() for _ in range(10))


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"slow_s": 0.1, "recovered_s": 0.1}, "recovered_s"),
        ({"slow_s": 0}, "slow_s"),
        ({"ema_weight": 1.5}, "ema_weight"),
        ({"probe_every_s": -1}, "probe_every_s"),
        ({"min_bandwidth_mb_s": 0}, "min_bandwidth_mb_s"),
        ({"slow": 1}, "slow"),
    ],
)
def test_bad_params_are_refused_naming_the_field(params, field):
    with pytest.raises(ValidationError, match=field):
        ThrottleParams(**params)


# -- in the put stage ----------------------------------------------------------------------


def _slow_store(seconds: float) -> RecordingStore:
    def put(key: str) -> int:
        time.sleep(seconds)
        return 0

    return RecordingStore(ScriptedStore(put=put))


QUICK = ThrottleParams(slow_s=0.02, recovered_s=0.005, ema_weight=1.0, probe_every_s=60)


async def test_once_puts_are_slow_the_put_stage_skips_them_and_counts_them_throttled():
    store = _slow_store(0.05)
    stage = PutStage(PutParams(throttle=QUICK), store)
    await stage.process_batch(batch_of([(fake_record("slow"),)]))  # 50 ms: shedding from now on

    batch = batch_of([(fake_record("a"), fake_record("b")), (fake_record("c"),)])
    await stage.process_batch(batch)

    assert store.put_keys == ["slow"]
    assert [entry.emit.counts["throttled"] for entry in batch] == [2, 1]
    assert all(not entry.emit.failures and entry.emit.dropped for entry in batch)


async def test_without_a_throttle_every_put_is_sent_however_slow():
    store = _slow_store(0.05)
    stage = PutStage(PutParams(throttle=None), store)

    for key in ("a", "b", "c"):
        await stage.process_batch(batch_of([(fake_record(key),)]))

    assert store.put_keys == ["a", "b", "c"] and stage.throttle is None


async def test_a_slow_call_sheds_the_calls_after_it_in_the_same_batch():
    store = _slow_store(0.05)
    stage = PutStage(PutParams(max_buffers_per_call=1, throttle=QUICK), store)
    batch = batch_of([(fake_record("a"), fake_record("b"), fake_record("c"))])

    await stage.process_batch(batch)

    assert store.put_keys == ["a"]
    assert (batch[0].emit.counts["put"], batch[0].emit.counts["throttled"]) == (1, 2)


#: a threshold far above what a busy machine adds between two clock reads
STARVED = ThrottleParams(slow_s=0.2, recovered_s=0.05, ema_weight=1.0, probe_every_s=60)


async def test_time_a_put_waited_for_a_cpu_is_not_the_stores_slowness():
    # saves run nicer than the engine: on a busy core their thread waits in the run queue
    waited = [0.0]

    def starved_put(key: str) -> int:
        started = time.monotonic()
        time.sleep(0.3)  # slower than slow_s: wall time alone would start shedding
        waited[0] += time.monotonic() - started  # ... all of it waiting for a CPU, not for the store
        return 0

    store = RecordingStore(ScriptedStore(put=starved_put))
    stage = PutStage(PutParams(throttle=STARVED), store, cpu_wait=lambda: waited[0])

    for key in ("a", "b", "c"):
        await stage.process_batch(batch_of([(fake_record(key),)]))

    assert store.put_keys == ["a", "b", "c"]
    assert stage.throttle is not None and not stage.throttle.shedding
