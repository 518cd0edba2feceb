"""Shedding saves while the store is slow: a latency detector with hysteresis.

A save is only a cache fill: skipping one costs a miss later, while waiting on a
store that takes a second per put holds the engine's blocks and fills every queue
behind it. A peer whose segment died is the common case: the master still hands
out its memory until the peer's lease runs out, and each put to it fails only
after the transfer engine's own timeout (~1 s), which the circuit breaker rightly
ignores (the master answers; the transfer fails).

The put stage tells :class:`SlowStoreThrottle` how long each call took and how
many bytes it moved. A call's time is measured in the thread that makes it, less
what that thread waited for a CPU: saves run nicer than the engine, and on a core
the engine keeps busy a fast put can wait hundreds of ms to run, which is the host
at work, not the store (measured in a fleet of one core per replica: read as
slowness, such waits started shedding 1-3 times per serving benchmark, and a chunk
whose save was shed was a miss on the next turn). What counts is the time *not*
explained by the bytes: that time minus ``bytes / min_bandwidth``, so a large
healthy put is never mistaken for a slow store. An exponential moving average of
that excess (weight ``ema_weight`` per call) smooths single hiccups. The two thresholds are
the hysteresis:

- above ``slow_s`` the throttle starts *shedding*: puts are skipped and their
  objects counted ``throttled`` (the job still ends, and releases its blocks, at once);
- while shedding, one call every ``probe_every_s`` goes through as a probe, and a
  probe whose excess is under ``recovered_s`` ends it (the average restarts from
  that probe, so the old slow streak cannot start shedding again at once).

A handoff's objects (:attr:`~.model.SaveRequest.handoff`: a decode engine waits
for them) are never shed: skipping one would cost that engine the whole prompt,
not a later miss. The put stage sends them while it sheds the rest.

``-200`` (store full) is not latency: the put stage's back-off slows its calls
for that, and the bounded queues in front of it shed what does not fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
from pydantic import BaseModel, ConfigDict, Field, model_validator

log = structlog.get_logger("kvpipe.stages.throttle")


class ThrottleParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slow_s: float = Field(0.25, gt=0)
    recovered_s: float = Field(0.05, ge=0)
    ema_weight: float = Field(0.3, gt=0, le=1)
    probe_every_s: float = Field(0.5, gt=0)
    min_bandwidth_mb_s: float = Field(100.0, gt=0)

    @model_validator(mode="after")
    def _hysteresis(self) -> ThrottleParams:
        if self.recovered_s >= self.slow_s:
            raise ValueError(f"recovered_s ({self.recovered_s}) must be < slow_s ({self.slow_s})")
        return self


DEFAULT_THROTTLE = ThrottleParams()


class SlowStoreThrottle:
    """Whether puts go to the store now; fed with every put call's time and size.

    Used from one event loop (the put stage's workers), so it needs no lock.
    """

    def __init__(self, params: ThrottleParams, clock: Callable[[], float] = time.monotonic) -> None:
        self.params = params
        self._clock = clock
        self._bytes_per_s = params.min_bandwidth_mb_s * 1e6
        self.excess_s = 0.0  # the moving average
        self.shedding = False
        self._next_probe_at = 0.0
        self.slow_spells = 0  # times it started shedding

    def allow(self) -> bool:
        """True if a put may go now: always, except once per ``probe_every_s`` while shedding."""
        if not self.shedding:
            return True
        now = self._clock()
        if now < self._next_probe_at:
            return False
        self._next_probe_at = now + self.params.probe_every_s
        return True

    def record(self, seconds: float, nbytes: int) -> None:
        """One put call took ``seconds`` to move ``nbytes``."""
        excess = max(0.0, seconds - nbytes / self._bytes_per_s)
        if self.shedding:
            if excess < self.params.recovered_s:
                self.shedding = False
                self.excess_s = excess
                log.info("store fast again: saves resume", probe_s=round(seconds, 3))
            return
        weight = self.params.ema_weight
        self.excess_s = weight * excess + (1 - weight) * self.excess_s
        if self.excess_s > self.params.slow_s:
            self.shedding = True
            self.slow_spells += 1
            self._next_probe_at = self._clock() + self.params.probe_every_s
            log.warning(
                "store slow: saves are skipped until a probe put is fast",
                excess_s=round(self.excess_s, 3),
                probe_every_s=self.params.probe_every_s,
            )
