"""The put back-off doubles while the store is full and resets once a call goes through."""

from kvpipe.stages import Backoff


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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


async def test_wait_returns_at_once_when_the_delay_has_already_passed():
    clock = _Clock()
    backoff = Backoff(10.0, 10.0, clock=clock)
    backoff.record(pressured=True)
    clock.now += 10.0

    await backoff.wait()  # would hang the test for 10 s if it slept


async def test_wait_returns_at_once_without_backpressure():
    backoff = Backoff(10.0, 10.0)

    await backoff.wait()
