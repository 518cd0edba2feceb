"""Exponential back-off while the store says it is full.

A ``-200`` (no space) means eviction has not caught up yet. Calling again at once
only adds load to a store that is already behind, so the put stage waits before
its next call: ``initial`` after the first refusal, doubling up to ``maximum``
while refusals continue, and not at all once a call goes through without one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio


class Backoff:
    def __init__(
        self, initial_s: float, maximum_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._initial_s = initial_s
        self._maximum_s = maximum_s
        self._clock = clock
        self.delay_s = 0.0
        self._resume_at = 0.0

    def record(self, *, pressured: bool) -> None:
        """Note how the last call went: ``pressured`` if the store refused anything for space."""
        if pressured:
            self.delay_s = min(self._maximum_s, self.delay_s * 2 if self.delay_s else self._initial_s)
            self._resume_at = self._clock() + self.delay_s
        else:
            self.delay_s = 0.0
            self._resume_at = 0.0

    async def wait(self) -> None:
        """Sleep out what is left of the current delay (time spent elsewhere counts)."""
        remaining = self._resume_at - self._clock()
        if remaining > 0:
            await anyio.sleep(remaining)
