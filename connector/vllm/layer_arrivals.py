"""Which layers of a step's layer-wise loads have landed: from the load stage's thread to the engine's.

The load stage reads a layered load's objects wave by wave (a wave: the byte
ranges a layer is the first to need, :mod:`kvpipe.stages.layers`) and tells each
wave as it lands, on the load pipeline's thread; the engine's thread, about to
run a layer's attention, waits for that layer's wave only. A wave is told once
its ranged get has returned, landed or failed: a record that failed fails its
blocks when the job ends, so the wait here is only for the bytes to be where
they will be.
"""

from __future__ import annotations

import threading
import time

from kvpipe.pipeline import Job
from kvpipe.stages import LoadRequest

#: how often a waiter looks at its job when no wave is told (a job refused before its
#: first wave tells none); the waves themselves wake it at once
JOB_POLL_S = 0.005


class LayerArrivals:
    """The waves told per submitted load request (thread-safe); the stage's :class:`~kvpipe.stages.LayerObserver`."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._landed: dict[int, int] = {}  # id(submitted request) -> waves told
        self._at: dict[int, list[float]] = {}  # id(submitted request) -> when each wave was told

    def __call__(self, request: LoadRequest, wave: int) -> None:
        now = time.monotonic()
        with self._changed:
            self._landed[id(request)] = wave + 1
            self._at.setdefault(id(request), []).append(now)
            self._changed.notify_all()

    def told_at(self, job: Job, wave: int) -> float | None:
        """When wave ``wave`` of ``job``'s request was told (``time.monotonic``); None: not yet."""
        with self._changed:
            told = self._at.get(id(job.item), [])
            return told[wave] if wave < len(told) else None

    def wait(self, job: Job, wave: int, timeout_s: float) -> bool:
        """Until wave ``wave`` of ``job``'s request is told, the job ends, or ``timeout_s`` passes: whether told."""
        key = id(job.item)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._landed.get(key, 0) <= wave:
                left = deadline - time.monotonic()
                if job.done or left <= 0:
                    return self._landed.get(key, 0) > wave
                self._changed.wait(min(left, JOB_POLL_S))
        return True

    def forget(self, job: Job) -> None:
        """The load has settled: its waves are no longer asked about."""
        with self._changed:
            self._landed.pop(id(job.item), None)
            self._at.pop(id(job.item), None)
