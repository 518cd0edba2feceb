"""The hook clock: a timed hook behaves as the method it wraps, and its costs add up per hook.

Every figure is a thread clock's or a sleep's lower bound, never a wall-time limit:
a busy machine can only make a hook's wall time longer.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvpipe.connector.bench.hook_clock import HookClock, HookReport, HookTime, timed_hooks

BURN_S = 0.02
SLEEP_S = 0.05


class Hooks:
    """What a connector would be: methods vLLM calls, each doing one thing measurable."""

    def echo(self, *args: Any, **kwargs: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        return self, args, kwargs

    def burn(self, seconds: float) -> None:
        """Use ``seconds`` of this thread's CPU."""
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def fail(self) -> None:
        raise LookupError("the hook's own error")

    def outer(self) -> str:
        self.burn(BURN_S)
        return self.inner()

    def inner(self) -> str:
        return "inner"


def timed(clock: HookClock, *hooks: str) -> Hooks:
    """A ``Hooks`` whose ``hooks`` time themselves on ``clock`` (a fresh subclass: ``Hooks`` stays as it is)."""

    @timed_hooks(clock, hooks)
    class Timed(Hooks):
        pass

    return Timed()


def test_a_timed_hook_gets_its_arguments_and_returns_its_answer_unchanged() -> None:
    hooks = timed(HookClock(), "echo")
    token = object()

    assert hooks.echo(token, 2, key=token) == (hooks, (token, 2), {"key": token})


def test_a_timed_hook_raises_the_methods_exception_and_the_call_still_counts() -> None:
    clock = HookClock()
    hooks = timed(clock, "fail")

    with pytest.raises(LookupError, match="the hook's own error"):
        hooks.fail()
    assert clock.take().hooks["fail"].calls == 1


def test_each_hook_adds_up_the_thread_cpu_of_its_calls() -> None:
    clock = HookClock()
    hooks = timed(clock, "burn", "echo")

    hooks.burn(BURN_S)
    hooks.burn(BURN_S)
    report = clock.take()

    assert report.hooks["burn"].calls == 2
    assert report.hooks["burn"].cpu_s >= 2 * BURN_S
    assert "echo" not in report.hooks  # never called: no entry


def test_time_asleep_in_a_hook_counts_as_blocked() -> None:
    clock = HookClock()
    hooks = timed(clock, "sleep")

    hooks.sleep(SLEEP_S)
    sleep = clock.take().hooks["sleep"]

    # a sleep is off the CPU and out of the run queue; the test's clocks differ by microseconds
    assert sleep.blocked_s >= 0.9 * SLEEP_S
    assert sleep.max_blocked_s == sleep.blocked_s


def test_a_hook_called_inside_another_is_the_outer_calls_time() -> None:
    clock = HookClock()
    hooks = timed(clock, "outer", "inner", "burn")

    assert hooks.outer() == "inner"
    report = clock.take()

    assert list(report.hooks) == ["outer"]
    assert report.hooks["outer"].cpu_s >= BURN_S


def test_a_take_reports_the_span_since_the_last_and_starts_afresh() -> None:
    clock = HookClock()
    hooks = timed(clock, "burn")
    clock.take()

    hooks.burn(BURN_S)
    Hooks().burn(BURN_S)  # untimed: the thread's CPU, not a hook's
    report = clock.take()

    assert report.thread_cpu_s >= 2 * BURN_S
    assert report.hooks["burn"].cpu_s < report.thread_cpu_s
    assert clock.take().hooks == {}


def test_a_report_sums_its_hooks_and_survives_json() -> None:
    report = HookReport(
        thread_cpu_s=2.0,
        hooks={
            "a": HookTime(calls=3, cpu_s=0.01, wall_s=0.02, blocked_s=0.003, max_blocked_s=0.002),
            "b": HookTime(calls=1, cpu_s=0.03, wall_s=0.03, blocked_s=0.001, max_blocked_s=0.001),
        },
    )

    assert (report.calls, report.cpu_share) == (4, pytest.approx(0.02))
    assert (report.mean_blocked_s, report.max_blocked_s) == (pytest.approx(0.001), 0.002)
    assert report.most_blocked == "a"
    assert HookReport.from_dict(report.as_dict()) == report


def test_timing_a_method_the_class_lacks_fails_when_the_class_is_made() -> None:
    with pytest.raises(AttributeError, match="renamed"):
        timed(HookClock(), "renamed")
