"""A circuit breaker around a store: when the master is gone, fail fast instead of waiting.

A stopped Mooncake master makes every call wait for its RPC timeout and then
answer -901 for every key; a killed one answers -900 after seconds of retries.
An engine saving and loading through such a store would pay that wait on every
call, so after ``failures_to_open`` consecutive calls that failed that way the
breaker *opens*: calls return -900 for every key at once, without touching the
store. After ``open_s`` one call is let through as a probe (*half-open*): if the
master answers, the breaker closes and traffic resumes; if not, it stays open
for another ``open_s``.

Only master trouble counts: a call whose every key came back -900/-901, or that
raised. A refused put (-200 store full, -800 transfer failed) is the store
working, and is left to the stages' own back-off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import StrEnum

import structlog
from pydantic import BaseModel, ConfigDict, Field

from kvpipe.stages.store import Code

from .protocol import ForwardingStore, Operation, Sizes, Store, StoreCall

log = structlog.get_logger("kvpipe.connector.store.breaker")

MASTER_TROUBLE = frozenset((Code.RPC_FAILED, Code.RPC_TIMEOUT))


class BreakerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    failures_to_open: int = Field(3, gt=0)
    open_s: float = Field(1.0, gt=0)


class BreakerState(StrEnum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls fail at once
    HALF_OPEN = "half_open"  # one probe call is in flight

    @property
    def level(self) -> int:
        """0 closed, 1 half-open, 2 open: how far from serving (a gauge's value)."""
        return _LEVELS[self]


_LEVELS = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class CircuitBreaker:
    """The state machine, thread-safe: store calls come from several threads."""

    def __init__(self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self.opened = 0  # times it opened
        self.refused = 0  # calls failed fast

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._state is BreakerState.OPEN and self._cooled_down():
                return BreakerState.HALF_OPEN  # the next call will be the probe
            return self._state

    def allow(self) -> bool:
        """Whether a call may go to the store now (if it may, ``record`` must follow)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._cooled_down():
                self._state = BreakerState.HALF_OPEN
                return True
            self.refused += 1
            return False

    def record(self, master_trouble: bool) -> None:
        """What the call that ``allow`` let through found."""
        with self._lock:
            if not master_trouble:
                if self._state is not BreakerState.CLOSED:
                    log.info("store reachable again: circuit closed")
                self._state = BreakerState.CLOSED
                self._failures = 0
                return
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or self._failures >= self.settings.failures_to_open:
                if self._state is BreakerState.CLOSED:
                    self.opened += 1
                    log.warning(
                        "store master unreachable: circuit open, calls fail fast",
                        failures=self._failures,
                        retry_in_s=self.settings.open_s,
                    )
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()

    def _cooled_down(self) -> bool:
        return self._clock() - self._opened_at >= self.settings.open_s


def breaker_of(store: Store) -> CircuitBreaker | None:
    """The breaker guarding ``store``, through any wrappers around it (None: unguarded)."""
    while True:
        if isinstance(store, GuardedStore):
            return store.breaker
        if not isinstance(store, ForwardingStore):
            return None
        store = store.inner


class GuardedStore(ForwardingStore):
    """A :class:`Store` whose master calls pass through a :class:`CircuitBreaker`.

    Everything else (close, register_buffer, capabilities) goes straight to the
    wrapped store: those are local or must happen whatever the master's state.
    """

    def __init__(self, store: Store, breaker: CircuitBreaker) -> None:
        super().__init__(store)
        self.breaker = breaker

    def _call(self, operation: Operation, n_keys: int, sizes: Sizes | None, call: StoreCall) -> list[int]:
        if not self.breaker.allow():
            return [Code.RPC_FAILED] * n_keys
        try:
            results = call()
        except BaseException:
            self.breaker.record(master_trouble=True)
            raise
        self.breaker.record(master_trouble=bool(results) and all(code in MASTER_TROUBLE for code in results))
        return results
