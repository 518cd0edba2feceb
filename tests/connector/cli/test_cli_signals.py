"""SIGTERM (what ``timeout`` sends) stops a command and everything it started: masters, engines.

Each test starts the command, waits until the processes it spawns are up, sends
SIGTERM to the command alone (as ``timeout`` does: the children are not told), and
checks the exit code and that none of the processes it had started is left.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

CONFIGS = Path(__file__).parents[3] / "configs"
UP_TIMEOUT_S = 120.0  # engines import vLLM first
DOWN_TIMEOUT_S = 60.0


def is_master(process: psutil.Process) -> bool:
    return "mooncake_master" in process.name()


def is_engine(process: psutil.Process) -> bool:
    return "kvpipe.connector.bench.vllm_engine" in " ".join(process.cmdline())


def is_replica(process: psutil.Process) -> bool:
    return "vllm.entrypoints.openai.api_server" in " ".join(process.cmdline())


def is_router(process: psutil.Process) -> bool:
    return "vllm::router" in process.name() or "vllm_router" in " ".join(process.cmdline())


class Command:
    """A ``kvpipe`` command in a process of its own, and every descendant it was seen with."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvpipe.connector.cli.main", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.seen: dict[int, psutil.Process] = {}

    def descendants(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.seen.update((child.pid, child) for child in found)
        return found

    def wait_for(self, *wanted: Callable[[psutil.Process], bool]) -> None:
        """Until a descendant matches each of ``wanted`` (the same predicate twice: two of them)."""
        deadline = time.monotonic() + UP_TIMEOUT_S
        while True:
            found = self.descendants()
            if all(
                sum(1 for child in found if _matches(want, child)) >= list(wanted).count(want)
                for want in wanted
            ):
                return
            assert self.process.poll() is None, (
                f"the command ended first: {self.process.communicate()[1][-2000:]}"
            )
            assert time.monotonic() < deadline, f"not up in {UP_TIMEOUT_S:g} s: {[c.name() for c in found]}"
            time.sleep(0.2)

    def survivors(self) -> list[psutil.Process]:
        return [p for p in self.seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    def stop(self) -> None:
        for process in [self.process, *self.seen.values()]:
            try:
                process.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        self.process.wait()


def _matches(want: Callable[[psutil.Process], bool], process: psutil.Process) -> bool:
    try:
        return want(process)
    except psutil.Error:
        return False


@pytest.fixture
def command() -> Iterator[Callable[..., Command]]:
    started: list[Command] = []

    def start(*args: str) -> Command:
        started.append(Command(*args))
        return started[-1]

    yield start
    for each in started:
        each.stop()


def terminated(command: Command) -> int:
    """SIGTERM to the command alone; its exit code (within the deadline)."""
    command.descendants()
    command.process.send_signal(signal.SIGTERM)
    return command.process.wait(timeout=DOWN_TIMEOUT_S)


def wait_gone(command: Command) -> list[psutil.Process]:
    """What is left of the command's processes once its deadline to stop them has passed."""
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while (left := command.survivors()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_sigterm_stops_the_main_job_and_the_master_it_spawned(command: Callable[..., Command]) -> None:
    run = command("run", str(CONFIGS / "mooncake.yaml"), "--set", "workload.requests=1000000")
    run.wait_for(is_master)
    assert terminated(run) == 128 + signal.SIGTERM
    assert wait_gone(run) == []


@pytest.mark.engine
def test_sigterm_stops_the_vllm_bench_its_masters_and_its_engines(command: Callable[..., Command]) -> None:
    bench = command("bench", "vllm", "--quick")
    bench.wait_for(is_master, is_master, is_engine)
    assert terminated(bench) == 128 + signal.SIGTERM
    assert wait_gone(bench) == []


@pytest.mark.engine
def test_sigterm_stops_the_fleet_its_replicas_its_router_and_its_store(command: Callable[..., Command]) -> None:
    fleet = command("fleet", "--replicas", "1", "--connector", "none")
    fleet.wait_for(is_master, is_replica, is_router)
    assert terminated(fleet) == 128 + signal.SIGTERM
    assert wait_gone(fleet) == []
