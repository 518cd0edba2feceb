"""Store-call telemetry: each master call's operation, outcome, time, keys and bytes.

An operator asks "how long do puts take, how many keys fail, how many bytes
move" per operation, not per stage: :class:`MeteredStore` answers it where
every call passes (the :class:`~.protocol.ForwardingStore` hook), so no stage has
to time its own calls and none can forget to. A call's record is a plain tuple
(cheap to keep and to ship to vLLM's logger process with the connector stats):
``(operation, status, seconds, keys, bytes, failed_keys)``.

- ``status`` is ``"ok"`` when no key came back negative and ``"error"`` otherwise
  (``failed_keys`` says how many; a call that raised counts every key failed);
- ``bytes`` are what moved: the buffers of the keys a put stored, the bytes a
  get read (an exist or a remove moves none).

The records wait in an :class:`OperationLog` until the connector drains it (each
engine step). The log is bounded: a drain that never comes (an engine that stops
stepping while saves still run) costs at most ``limit`` records, and the ones
refused are counted, so a gap in the histograms is visible rather than silent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .protocol import ForwardingStore, Operation, Sizes, Store, StoreCall

__all__ = ["MeteredStore", "OperationLog", "OperationRecord"]

#: (operation, status, seconds, keys, bytes, failed keys)
OperationRecord = tuple[str, str, float, int, int, int]

#: Records kept between two drains (an engine drains every step; this is hours of a stall).
RECORDS_LIMIT = 16384


class OperationLog:
    """Records of store calls since the last :meth:`drain`; thread-safe (stages call from their threads)."""

    def __init__(self, limit: int = RECORDS_LIMIT) -> None:
        self._limit = limit
        self._records: list[OperationRecord] = []
        self._refused = 0
        self._lock = threading.Lock()

    def add(self, record: OperationRecord) -> None:
        with self._lock:
            if len(self._records) < self._limit:
                self._records.append(record)
            else:
                self._refused += 1

    def drain(self) -> tuple[list[OperationRecord], int]:
        """The records since the last drain, and how many were refused for want of room."""
        with self._lock:
            records, self._records = self._records, []
            refused, self._refused = self._refused, 0
        return records, refused


class MeteredStore(ForwardingStore):
    """A :class:`~.protocol.Store` that records every master call into an :class:`OperationLog`."""

    def __init__(
        self, store: Store, log: OperationLog, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        super().__init__(store)
        self.log = log
        self._clock = clock

    def _call(self, operation: Operation, n_keys: int, sizes: Sizes | None, call: StoreCall) -> list[int]:
        started = self._clock()
        try:
            results = call()
        except BaseException:
            self.log.add((operation, "error", self._clock() - started, n_keys, 0, n_keys))
            raise
        seconds = self._clock() - started
        failed = sum(1 for code in results if code < 0)
        if operation == "get":
            moved = sum(code for code in results if code > 0)
        elif operation == "put" and sizes is not None:
            moved = sum(sum(buffers) for buffers, code in zip(sizes, results, strict=False) if code == 0)
        else:
            moved = 0
        self.log.add((operation, "error" if failed else "ok", seconds, n_keys, moved, failed))
        return results
