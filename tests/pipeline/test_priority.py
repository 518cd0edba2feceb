"""A pipeline's threads can run nicer than the threads that feed it (Linux: nice per thread)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import anyio
import pytest

from kvpipe.pipeline import Emit, Stage, SyncPipeline, priority
from kvpipe.pipeline.priority import checked_nice, cpu_wait_seconds, lower_this_thread

from .toy_stages import chain

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="nice values per thread are Linux's"
)


def nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class NiceProbe(Stage):
    """A sink that records the nice value of the loop thread and of a worker thread it starts."""

    ports = ()

    def __init__(self) -> None:
        self.loop_nice: int | None = None
        self.worker_nice: int | None = None

    async def process(self, item: object, emit: Emit) -> None:
        self.loop_nice = nice_of_this_thread()
        self.worker_nice = await anyio.to_thread.run_sync(nice_of_this_thread)


def in_a_thread(function):  # type: ignore[no-untyped-def]
    """``function()``'s result, called in a new thread (the calling thread's nice stays as it is)."""
    box = []
    thread = threading.Thread(target=lambda: box.append(function()))
    thread.start()
    thread.join()
    return box[0]


@linux_only
def test_a_thread_lowers_its_own_priority_and_the_threads_it_starts_inherit_it() -> None:
    before = nice_of_this_thread()

    def lower_then_start_one() -> tuple[bool, int, int]:
        lowered = lower_this_thread(3)
        return lowered, nice_of_this_thread(), in_a_thread(nice_of_this_thread)

    lowered, own, child = in_a_thread(lower_then_start_one)
    assert lowered
    assert own == child == min(19, before + 3)
    assert nice_of_this_thread() == before  # the caller's thread is left as it was


def test_an_increment_of_zero_changes_nothing() -> None:
    assert in_a_thread(lambda: (lower_this_thread(0), nice_of_this_thread())) == (
        False,
        nice_of_this_thread(),
    )


@linux_only
def test_a_nice_pipeline_runs_its_stages_and_their_worker_threads_nicer_than_its_caller() -> None:
    probe = NiceProbe()
    before = nice_of_this_thread()
    with SyncPipeline(chain(probe), nice=4) as bridge:
        assert bridge.submit("item").wait(10.0)
    assert probe.loop_nice == probe.worker_nice == min(19, before + 4)
    assert nice_of_this_thread() == before


def test_a_pipeline_runs_at_its_callers_priority_by_default() -> None:
    probe = NiceProbe()
    with SyncPipeline(chain(probe)) as bridge:
        assert bridge.submit("item").wait(10.0)
    assert probe.loop_nice == probe.worker_nice == nice_of_this_thread()


@pytest.mark.parametrize("value", [-1, 20, 2.5, "5", True])
def test_a_nice_increment_outside_0_to_19_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=rf"nice: must be an integer from 0 to 19, got {value!r}"):
        SyncPipeline(chain(NiceProbe()), nice=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="save_nice: must be"):
        checked_nice(value, "save_nice")


def _run_queue_seconds() -> float:
    with open("/proc/thread-self/schedstat") as stats:
        return int(stats.read().split()[1]) / 1e9


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no schedstat here")
def test_cpu_wait_is_the_calling_threads_time_in_the_run_queue() -> None:
    before = _run_queue_seconds()
    waited = cpu_wait_seconds()
    after = _run_queue_seconds()

    assert before <= waited <= after


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no schedstat here")
def test_cpu_wait_is_each_threads_own() -> None:
    cpu_wait_seconds()  # this thread's file is open now
    readings: list[float] = []

    def another() -> None:
        readings.extend((_run_queue_seconds(), cpu_wait_seconds(), _run_queue_seconds()))

    thread = threading.Thread(target=another)
    thread.start()
    thread.join()
    before, waited, after = readings
    assert before <= waited <= after


def test_cpu_wait_is_zero_where_the_system_does_not_say(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(priority, "SCHEDSTAT_PATH", str(tmp_path / "no-schedstat"))

    assert cpu_wait_seconds() == 0.0
