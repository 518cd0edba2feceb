"""What became of each store object: reported to its job and, optionally, to an observer.

Every record that reaches ``filter`` ends as exactly one of :class:`ObjectStatus`:
``existing`` (the store had it), ``put`` (we stored it), ``failed``, or
``throttled`` (not sent: the store was too slow, see ``throttle.py``). The job of
the request it came from counts it under that name, so ``considered = existing +
put + failed + throttled`` holds per job; a failed one is also counted under its
:class:`FailReason` (``failed_deadline``, ...), so that every object not stored has a why. An :class:`ObjectObserver` (the build resource
``observer``) additionally sees each record with its status, on the pipeline's
loop thread: how a caller learns *which* objects were stored (a report of every
object, a connector tracking the chunks it may announce), not just how many.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

from kvpipe.pipeline.stage import BatchEntry, Emit

from .model import Records, StoreObject

DEADLINE_PASSED = "the job's deadline passed; not sent"


class ObjectStatus(StrEnum):
    """What became of one store object (a job's own end is :class:`kvpipe.pipeline.Outcome`)."""

    PUT = "put"
    EXISTING = "existing"
    FAILED = "failed"
    THROTTLED = "throttled"


#: each status's count name, read per record: an enum's ``.value`` is a slow property
_COUNT_NAME = {status: status.value for status in ObjectStatus}


class FailReason(StrEnum):
    """Why a failed object was not stored (a job counts it as ``failed_<reason>`` too)."""

    STORE_ERROR = "store_error"  # the store answered an error code, or its call failed
    NO_SPACE = "no_space"  # refused for space, after the put stage's back-off
    DEADLINE = "deadline"  # its job's deadline passed before it was sent
    ROLLED_BACK = "rolled_back"  # its chunk was torn: removed, so that no half chunk stays
    TOO_LARGE = "too_large"  # more buffers than one put call may carry
    CALLED_OFF = "called_off"  # written layer by layer, its step failed (or never ended): revoked unseen


#: each reason's count name in a job's counts
FAILED_COUNT_NAMES = {reason: f"failed_{reason.value}" for reason in FailReason}


class ObjectObserver(Protocol):
    """Called once per record with its final status; must be quick (it runs on the loop)."""

    def __call__(self, record: StoreObject, status: ObjectStatus) -> None: ...


class ObjectReporter:
    """Reports each record's :class:`ObjectStatus` for one stage: to its job's counts, as success or failure, and to the observer."""

    def __init__(self, observer: ObjectObserver | None = None) -> None:
        self._observer = observer

    def stored(self, emit: Emit, record: StoreObject) -> None:
        self._settle(emit, record, ObjectStatus.PUT)
        emit.succeed()

    def existing(self, emit: Emit, record: StoreObject) -> None:
        self._settle(emit, record, ObjectStatus.EXISTING)
        emit.succeed()

    def all_stored(self, emit: Emit, records: Sequence[StoreObject]) -> None:
        """:meth:`stored` for several records of one job, counted at once."""
        self._all(emit, records, ObjectStatus.PUT)

    def all_existing(self, emit: Emit, records: Sequence[StoreObject]) -> None:
        """:meth:`existing` for several records of one job, counted at once."""
        self._all(emit, records, ObjectStatus.EXISTING)

    def all_throttled(self, emit: Emit, records: Sequence[StoreObject]) -> None:
        """Records of one job not sent because the store is slow: a deliberate drop, not a failure."""
        if not records:
            return
        emit.count(_COUNT_NAME[ObjectStatus.THROTTLED], len(records))
        emit.drop("store slow: put skipped")
        if self._observer is not None:
            for record in records:
                self._observer(record, ObjectStatus.THROTTLED)

    def _all(self, emit: Emit, records: Sequence[StoreObject], status: ObjectStatus) -> None:
        if not records:
            return
        emit.count(_COUNT_NAME[status], len(records))
        emit.succeed(len(records))
        if self._observer is not None:
            for record in records:
                self._observer(record, status)

    def fail_expired(self, batch: Sequence[BatchEntry[Records]], call: str) -> list[BatchEntry[Records]]:
        """Fail the records of entries whose job is past its deadline; the other entries."""
        live = []
        for entry in batch:
            if entry.emit.expired:
                for record in entry.item:
                    self.failed(
                        entry.emit, record, f"{call} {record.key}: {DEADLINE_PASSED}", FailReason.DEADLINE
                    )
            else:
                live.append(entry)
        return live

    def failed(self, emit: Emit, record: StoreObject, message: str, reason: FailReason) -> None:
        self._settle(emit, record, ObjectStatus.FAILED)
        emit.count(FAILED_COUNT_NAMES[reason])
        emit.fail(message)

    def _settle(self, emit: Emit, record: StoreObject, status: ObjectStatus) -> None:
        emit.count(_COUNT_NAME[status])
        if self._observer is not None:
            self._observer(record, status)
