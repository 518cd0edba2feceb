"""Jobs: knowing when everything that came of one submitted item is finished.

Every submitted item opens a :class:`Job`. The runtime keeps one number per job,
``pending``: how many items derived from it are queued or being processed. A
submit makes it 1; each emit adds one per destination *before* the item is queued;
the end of each item's processing (forwarded, dropped, failed or raised) takes one
away. The job completes when it reaches zero, which is exactly when no work
derived from it can happen any more, across fan-out, batches mixing jobs, drops
and errors. A KV connector uses that moment to learn what became of a request's blocks.

A job may have a deadline (``deadline_s`` after its submit). Nothing in flight
is interrupted at the deadline (a store call may be reading the lent memory), but
stages that call out check :attr:`Job.expired` and start no new call for it, so
a job ends within its deadline plus one call.

A second number, ``borrowing``, counts only the items that may still read
memory the submitter lent with the item (a KV connector's blocks). A stage that
copied what it needed (a gather into its own staging) emits with
``released=True``, and that item and everything derived from it stop counting.
The job is *released* when ``borrowing`` reaches zero: often long before it
completes, while the slow network put still runs. Completing releases too.

All bookkeeping happens on the pipeline's event-loop thread, so it needs no locks;
other threads only wait on the job (:meth:`Job.wait`) or read it once done.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import anyio


class Outcome(StrEnum):
    OK = "ok"  # every unit of work succeeded (or was deliberately dropped)
    PARTIAL = "partial"  # some units failed, some succeeded or were dropped
    FAILED = "failed"  # units failed and none succeeded
    DROPPED = "dropped"  # refused at the entry (queue full under the drop policy)


_job_ids = itertools.count(1)  # next() on a count is atomic under the GIL
# Guards the lazy creation of a job's threading.Event between waiting threads:
# most jobs are never waited on by a thread, and an Event per job costs more than
# the rest of a job's bookkeeping. Completion takes no lock (see Job.wait).
_waiters_lock = threading.Lock()


class Counts(dict[str, int]):
    """Named counters: a missing name reads as 0, as with ``Counter``.

    Not ``Counter`` itself: every submit makes one, on the submitter's thread,
    and Counter's Python-level constructor cost more there than the rest of
    the submit (profiled with py-spy).
    """

    __slots__ = ()

    def __missing__(self, key: str) -> int:
        return 0


def checked_deadline(job_deadline_s: float | None) -> float | None:
    """``job_deadline_s`` as a pipeline takes it: None (no deadline) or > 0."""
    if job_deadline_s is not None and job_deadline_s <= 0:
        raise ValueError(f"job_deadline_s: must be > 0, got {job_deadline_s}")
    return job_deadline_s


class Job:
    """One submitted item and the outcome of all work derived from it."""

    __slots__ = (
        "id",
        "item",
        "submitted_at",
        "deadline",
        "finished_at",
        "outcome",
        "counts",
        "first_error",
        "failed_units",
        "succeeded_units",
        "dropped_items",
        "pending",
        "borrowing",
        "released_at",
        "_finished",
        "_async_finished",
        "_release_callbacks",
    )

    def __init__(self, item: Any, deadline_s: float | None = None) -> None:
        self.id: int = next(_job_ids)
        self.item = item
        self.submitted_at = time.monotonic()
        self.deadline = math.inf if deadline_s is None else self.submitted_at + deadline_s
        self.finished_at: float | None = None
        self.outcome: Outcome | None = None
        self.counts = Counts()
        self.first_error: str | None = None
        self.failed_units = 0
        self.succeeded_units = 0
        self.dropped_items = 0
        self.pending = 0
        self._finished: threading.Event | None = None
        self._async_finished: anyio.Event | None = None
        self.borrowing = 0
        self.released_at: float | None = None
        self._release_callbacks: list[Callable[[Job], None]] | None = None  # most jobs have none

    def __repr__(self) -> str:
        state = self.outcome.value if self.outcome else f"pending={self.pending}"
        return f"<Job {self.id} {state} {dict(self.counts)}>"

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def expired(self) -> bool:
        """Whether the job's deadline has passed: start no new work for it."""
        return self.deadline < math.inf and time.monotonic() > self.deadline

    @property
    def elapsed_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    def wait(self, timeout: float | None = None) -> bool:
        """Block this (non-loop) thread until the job is done; False on timeout.

        Never raises: what went wrong in the stages is the job's :attr:`outcome`
        (``failed``, ``partial``) and :attr:`first_error`, not an exception here.
        """
        if self.done:
            return True  # no Event: most waits come after the end
        with _waiters_lock:
            if self._finished is None:
                self._finished = threading.Event()
            finished = self._finished
        # complete() sets the outcome, then reads _finished: had it read it before the
        # event was stored, the outcome is set by now (the GIL orders the two threads).
        return self.outcome is not None or finished.wait(timeout)

    async def finished(self) -> Job:
        """Wait on the pipeline's event loop until the job is done; returns the job.

        Raises nothing but the caller's cancellation: as with :meth:`wait`, failures
        are the job's :attr:`outcome` and :attr:`first_error`.
        """
        if not self.done:
            if self._async_finished is None:
                self._async_finished = anyio.Event()
            await self._async_finished.wait()
        return self

    @property
    def released(self) -> bool:
        """Whether nothing derived from the item still reads what the submitter lent."""
        return self.released_at is not None

    def add_release_callback(self, callback: Callable[[Job], None]) -> None:
        """Run ``callback(job)`` on the loop thread once released (at once if it is)."""
        if self.released:
            callback(self)
        elif self._release_callbacks is None:
            self._release_callbacks = [callback]
        else:
            self._release_callbacks.append(callback)

    # -- bookkeeping, called by the runtime on the loop thread ---------------

    def release(self, now: float | None = None) -> None:
        """Mark the submitter's memory free (once), at ``now`` if given; the runtime calls it."""
        if self.released_at is not None:
            return
        self.released_at = time.monotonic() if now is None else now
        callbacks, self._release_callbacks = self._release_callbacks, None
        if callbacks is not None:
            for callback in callbacks:
                callback(self)

    def record_failure(self, error: str | BaseException, units: int = 1) -> None:
        self.failed_units += units
        if self.first_error is None:
            self.first_error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"

    def complete(self, outcome: Outcome | None = None) -> None:
        """End the job; the outcome follows from its units unless given."""
        if self.outcome is not None:
            return
        now = time.monotonic()
        self.release(now)  # nothing derived from the item runs any more
        if outcome is None:
            if self.failed_units == 0:
                outcome = Outcome.OK
            elif self.succeeded_units or self.dropped_items:
                outcome = Outcome.PARTIAL
            else:
                outcome = Outcome.FAILED
        self.finished_at = now
        self.outcome = outcome
        finished = self._finished  # read after the outcome is set: Job.wait relies on the order
        if finished is not None:
            finished.set()
        if self._async_finished is not None:
            self._async_finished.set()


class JobTracker:
    """The open jobs of one pipeline, so that none is forgotten on cancellation."""

    def __init__(self, on_complete: Callable[[Job], None] | None = None) -> None:
        self._open: dict[int, Job] = {}
        self._on_complete = on_complete
        # Most jobs end ok: a plain int for those, since hashing an Outcome (a str
        # subclass) to count it cost a tenth of a job's bookkeeping.
        self._ok = 0
        self._not_ok: Counter[Outcome] = Counter()

    def __len__(self) -> int:
        return len(self._open)

    @property
    def outcomes(self) -> Counter[Outcome]:
        """How many jobs ended with each outcome (outcomes no job had are absent)."""
        ended = Counter(self._not_ok)
        if self._ok:
            ended[Outcome.OK] = self._ok
        return ended

    def open(self, job: Job) -> Job:
        job.pending = 1
        job.borrowing = 1
        self._open[job.id] = job
        return job

    def settle(self, job: Job, borrowed: bool = True) -> None:
        """One derived item of ``job`` is finished; complete the job at zero.

        ``borrowed``: the item was at a stage that may read the submitter's
        memory; the job is released when the last such item is finished.
        """
        job.pending -= 1
        if borrowed:
            job.borrowing -= 1
        if job.pending == 0:
            self._finish(job, None)  # which releases it too: nothing borrows when nothing is pending
        elif borrowed and job.borrowing == 0:
            job.release()

    def end(self, job: Job, outcome: Outcome, error: str | None = None) -> None:
        """End a job whatever is pending (cancellation, refusal at the entry)."""
        if error is not None:
            job.record_failure(error, units=0)
        job.pending = 0
        self._finish(job, outcome)

    def end_all(self, outcome: Outcome, error: str) -> int:
        """End every open job (the pipeline was cancelled); returns how many."""
        jobs = list(self._open.values())
        for job in jobs:
            self.end(job, outcome, error)
        return len(jobs)

    def _finish(self, job: Job, outcome: Outcome | None) -> None:
        self._open.pop(job.id, None)
        job.complete(outcome)
        assert job.outcome is not None  # complete() set it (or had, for a job already done)
        if job.outcome is Outcome.OK:
            self._ok += 1
        else:
            self._not_ok[job.outcome] += 1
        if self._on_complete is not None:
            self._on_complete(job)
