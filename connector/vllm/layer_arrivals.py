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
    """The waves told per submitted load request (thread-safe); the stage's :class:`~kvpipe.stages.LayerObserver`.

    Each entry holds its request, so no later request can take its id while the
    entry is there (a given-up load's stage may still tell waves after it was
    forgotten: it is forgotten again when its call ends).
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        # id(submitted request) -> it, and when each of its waves was told (time.monotonic)
        self._told: dict[int, tuple[LoadRequest, list[float]]] = {}

    def __call__(self, request: LoadRequest, wave: int) -> None:
        now = time.monotonic()
        with self._changed:
            self._told.setdefault(id(request), (request, []))[1].append(now)
            self._changed.notify_all()

    def _waves(self, job: Job) -> list[float]:
        """The told times of ``job``'s request (the lock held)."""
        held = self._told.get(id(job.item))
        return held[1] if held is not None and held[0] is job.item else []

    def told_at(self, job: Job, wave: int) -> float | None:
        """When wave ``wave`` of ``job``'s request was told (``time.monotonic``); None: not yet."""
        with self._changed:
            told = self._waves(job)
            return told[wave] if wave < len(told) else None

    def wait(self, job: Job, wave: int, timeout_s: float) -> bool:
        """Until wave ``wave`` of ``job``'s request is told, the job ends, or ``timeout_s`` passes: whether told."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while len(self._waves(job)) <= wave:
                left = deadline - time.monotonic()
                if job.done or left <= 0:
                    return len(self._waves(job)) > wave
                self._changed.wait(min(left, JOB_POLL_S))
        return True

    def forget(self, job: Job) -> None:
        """The load has settled (or its given-up call ended): its waves are no longer asked about."""
        with self._changed:
            held = self._told.get(id(job.item))
            if held is not None and held[0] is job.item:
                del self._told[id(job.item)]
