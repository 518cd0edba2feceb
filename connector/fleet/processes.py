"""A child process in a session of its own, its output in a log file, stopped with everything it spawned.

A ``vllm serve`` replica is an API server that spawns an engine core; the router
is a Python launcher around a Rust server. Stopping only the process we started
would leave the others running, so each :class:`GroupProcess` starts a new
session (its own process group), remembers every process seen in that group
while it runs, and on :meth:`GroupProcess.stop` sends SIGTERM to the group, then
SIGKILL after a deadline, then checks that none of the processes it saw is left
(psutil tells a reused pid from the original). A group its owner never stops
(a :class:`~kvpipe.connector.fleet.Fleet` used without ``with``, an error
between a start and its stop) is stopped when the owner's interpreter exits
(:mod:`kvpipe.connector.exit_guard`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import psutil

from kvpipe.connector import exit_guard

#: how long a group left running by its owner gets to end on SIGTERM, at the owner's exit
EXIT_STOP_S = 10.0


class ProcessError(RuntimeError):
    """A process did not start or stop as it should; the message ends with its log's tail."""


class GroupProcess:
    """One command, run in its own process group with its output in ``log_path``."""

    def __init__(self, name: str, command: Sequence[str], log_path: Path, env: Mapping[str, str]) -> None:
        self.name = name
        self.command = list(command)
        self.log_path = log_path
        self._env = dict(env)
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._known: dict[int, psutil.Process] = {}  # every process of its group seen so far

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def start(self) -> None:
        """Spawn the command (it returns at once; the caller waits for readiness its own way).

        :raises ProcessError: it is already running.
        """
        if self._process is not None:
            raise ProcessError(f"{self.name} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        command = [*self.command]
        self._process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._env,
            start_new_session=True,  # its own process group: stop() ends its children too
        )
        exit_guard.guard(self, lambda: self.stop(EXIT_STOP_S))
        self.track()

    def track(self) -> None:
        """Remember the group's processes alive now (call while it runs: children come and go)."""
        for process in self._group_processes():
            self._known.setdefault(process.pid, process)

    def _group_processes(self) -> list[psutil.Process]:
        """The leader's descendants and anything else in its process group, alive now."""
        assert self._process is not None
        pgid = self._process.pid  # start_new_session: the group is named after the leader
        found: dict[int, psutil.Process] = {}
        try:
            leader = psutil.Process(pgid)
            found[leader.pid] = leader
            found.update((child.pid, child) for child in leader.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) == pgid:
                    found[process.pid] = process
            except (ProcessLookupError, psutil.Error):
                continue
        return list(found.values())

    def survivors(self) -> list[psutil.Process]:
        """Processes it started that still run (zombies aside)."""
        alive = []
        for process in self._known.values():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except psutil.NoSuchProcess:
                continue
        return alive

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the whole group (e.g. SIGKILL, to play a lost machine)."""
        if self._process is not None:
            self.track()
            _signal_group(self._process.pid, sig)

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to the whole group, SIGKILL after ``timeout_s``; none of its processes survives.

        :raises ProcessError: a process survived SIGKILL (it cannot happen short of a kernel hang).
        """
        process = self._process
        if process is None:
            return
        try:
            self.track()
            pgid = process.pid
            _signal_group(pgid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and (process.poll() is None or self.survivors()):
                self.track()
                time.sleep(0.1)
            if process.poll() is None or self.survivors():
                _signal_group(pgid, signal.SIGKILL)
                for straggler in self.survivors():  # one that left the group, if any
                    straggler.kill()
            process.wait(timeout=10)
            _, still = psutil.wait_procs(self.survivors(), timeout=10)
            if still:
                raise ProcessError(f"{self.name}: processes survived SIGKILL: {[p.pid for p in still]}")
        finally:
            exit_guard.release(self)
            self._process = None
            if self._log is not None:
                self._log.close()
                self._log = None

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").rstrip().splitlines()[-lines:])

    def tail_suffix(self) -> str:
        """``; log PATH, its tail: ...``, for the end of an error message."""
        return f"; log {self.log_path}, its tail:\n{self.log_tail()}"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
