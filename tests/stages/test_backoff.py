"""The put back-off doubles while the store is full and resets once a call goes through."""

import anyio
import pytest

from kvpipe.stages import Backoff
from kvpipe.stages import backoff as backoff_module

from .clock import Clock


def test_delay_starts_at_initial_doubles_and_is_capped():
    backoff = Backoff(0.01, 0.05)
    delays = []
    for _ in range(5):
        backoff.record(pressured=True)
        delays.append(backoff.delay_s)

    assert delays == [0.01, 0.02, 0.04, 0.05, 0.05]


def test_a_call_without_backpressure_resets_the_delay():
    backoff = Backoff(0.01, 0.2)
    backoff.record(pressured=True)
    backoff.record(pressured=True)

    backoff.record(pressured=False)
    backoff.record(pressured=True)

    assert backoff.delay_s == 0.01


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """What the back-off asked to sleep, instead of sleeping it."""
    asked: list[float] = []

    async def sleep(seconds: float) -> None:
        asked.append(seconds)

    monkeypatch.setattr(backoff_module.anyio, "sleep", sleep)
    return asked


async def test_wait_sleeps_out_what_is_left_of_the_delay(sleeps):
    clock = Clock(100.0)
    backoff = Backoff(10.0, 10.0, clock=clock)
    backoff.record(pressured=True)
    clock.now += 4.0

    with anyio.fail_after(1):
        await backoff.wait()

    assert sleeps == [pytest.approx(6.0)]


async def test_wait_returns_at_once_when_the_delay_has_already_passed(sleeps):
    clock = Clock(100.0)
    backoff = Backoff(10.0, 10.0, clock=clock)
    backoff.record(pressured=True)
    clock.now += 10.0

    with anyio.fail_after(1):
        await backoff.wait()

    assert sleeps == []


async def test_wait_returns_at_once_without_backpressure(sleeps):
    backoff = Backoff(10.0, 10.0)

    with anyio.fail_after(1):
        await backoff.wait()

    assert sleeps == []
