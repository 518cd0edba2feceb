"""Running a pipeline from ordinary threads: the sync bridge.

An inference engine calls us from its model-step thread, which must never wait on
our queues. :class:`SyncPipeline` runs the pipeline on an event loop in a thread
of its own, and :meth:`SyncPipeline.submit` only appends the item to a deque and,
if the loop is idle, asks a waker thread to poke it awake: a few microseconds,
whatever the pipeline is doing.

Why a waker thread: waking the loop means ``call_soon_threadsafe``, whose
self-pipe write releases the GIL. On a busy machine the submitter then waits
for a store or loop thread to give the GIL back, up to a switch interval (5 ms):
measured 2-5 ms submits under store faults. Putting a token on a
``queue.SimpleQueue`` never releases the GIL, so the waker pays that instead.

The entry is bounded by ``queue_capacity``: at most that many items are
submitted but not yet in the pipeline's entry queue. When it is full the policy
decides: ``"wait"`` blocks the caller until there is room (for batch jobs that
must not lose work), ``"drop"`` refuses the item at once and ends its job as
``dropped`` (for a connector in the engine's hot loop: a lost save costs a cache
miss later; a blocked step costs every request now).

With ``job_deadline_s`` every job gets that deadline (see :class:`Job`): the
stages that call out start no new call for a job past it. With ``nice`` the
loop thread, the waker and every worker thread the stages start run that much
nicer than the thread that starts the pipeline (:mod:`.priority`): its work
takes what CPU the caller's threads leave.

An item may come with ``ready``, a call that blocks until the item may be read
(the connector's device copies into the slots it names): the pump calls it in a
worker thread before the item enters the pipeline, so the submitter never waits
for it. Consecutive items with the same ``ready`` wait once.

Completed jobs are handed back through :meth:`completed` (poll) or
:meth:`Job.wait`. :meth:`stop` drains within a deadline and then cancels, and in
every case ends every job it ever returned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import queue
import threading
from collections import deque
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Self, TypeVar

import anyio
import structlog

from .errors import PipelineClosed
from .graph import Graph
from .jobs import Job, Outcome, checked_deadline
from .metrics import StageSnapshot
from .priority import checked_nice, lower_this_thread
from .runtime import Pipeline

R = TypeVar("R")
#: blocks until an item may be read; what it raises fails the item's job
Ready = Callable[[], object]
log = structlog.get_logger("kvpipe.pipeline")


class WhenFull(StrEnum):
    WAIT = "wait"
    DROP = "drop"


class _State(StrEnum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class SyncPipeline:
    """A pipeline on its own event-loop thread, fed from any thread.

    Raises ValueError when ``queue_capacity`` is not > 0, ``job_deadline_s`` is
    given and not > 0, ``nice`` is not an integer from 0 to 19, or ``when_full``
    is not a :class:`WhenFull` value.
    """

    def __init__(
        self,
        graph: Graph,
        *,
        queue_capacity: int = 1024,
        when_full: WhenFull | str = WhenFull.WAIT,
        name: str = "pipeline",
        keep_completed: bool = True,
        job_deadline_s: float | None = None,
        nice: int = 0,
    ) -> None:
        if queue_capacity <= 0:
            raise ValueError(f"queue_capacity: must be > 0, got {queue_capacity}")
        self.job_deadline_s = checked_deadline(job_deadline_s)
        self.nice = checked_nice(nice)
        self.graph = graph
        self.name = name
        self.when_full = WhenFull(when_full)
        self._keep_completed = keep_completed
        self._capacity = queue_capacity
        self._inbox: deque[tuple[Job, Ready | None]] = deque()
        self._completed: queue.SimpleQueue[Job] = queue.SimpleQueue()
        # One plain lock guards the state and the submitted count among submitters:
        # a submit takes it once; the pump only to wake blocked ones (a contended lock is a
        # GIL hand-off). (A threading.Semaphore per submit cost more than the
        # submit's own work.)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # waited on only when full, under "wait"
        self._waiting = 0
        # Submitted minus taken is what waits in the inbox. ``_taken`` has one writer,
        # the pump, which so needs no lock per item (see _pump for the wake-up order).
        self._taken = 0
        self._state = _State.NEW
        self._dropped = 0
        self._submitted = 0
        self._thread: threading.Thread | None = None
        self._waker: threading.Thread | None = None
        self._wake_requests: queue.SimpleQueue[bool] = queue.SimpleQueue()  # True: wake; False: exit
        self._started = threading.Event()
        self._startup_error: BaseException | None = None
        self._drain_deadline_s: float | None = None
        self._drained = False
        # Loop-side state, created on the loop thread.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pipeline: Pipeline | None = None
        self._pump_idle = False  # raised by the pump, lowered by the submit that wakes it
        self._wakeup: anyio.Event | None = None
        self._stop_requested: anyio.Event | None = None

    # -- lifecycle ----------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> Self:
        """Start the loop thread and the pipeline on it (its stages' ``start``); returns self.

        Raises RuntimeError when it was started before (stopped included), TimeoutError
        when the pipeline is not running within ``timeout_s``, and, re-raised here,
        what starting the pipeline raised on the loop thread (a stage's ``start``).
        """
        with self._lock:
            if self._state is not _State.NEW:
                raise RuntimeError(f"{self.name} was already started")
            self._state = _State.RUNNING
        self._thread = threading.Thread(target=self._thread_main, name=f"kvpipe-{self.name}", daemon=True)
        self._waker = threading.Thread(target=self._waker_main, name=f"kvpipe-{self.name}-waker", daemon=True)
        self._thread.start()
        self._waker.start()
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"{self.name} did not start within {timeout_s} s")
        if self._startup_error is not None:
            raise self._startup_error
        return self

    def stop(self, deadline_s: float | None = 10.0) -> bool:
        """Drain what was submitted for at most ``deadline_s``, then cancel the rest.

        Returns True if everything drained. Every job submitted is done afterwards.
        """
        with self._lock:
            if self._state in (_State.NEW, _State.STOPPED):
                self._state = _State.STOPPED
                return True
            self._state = _State.STOPPING
            self._room.notify_all()  # blocked submits give up: the pipeline is closing
        self._drain_deadline_s = deadline_s
        self._call_soon(self._request_stop)
        assert self._thread is not None and self._waker is not None
        self._thread.join()
        self._waker.join()
        return self._drained

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- submitting ---------------------------------------------------------

    def submit(self, item: Any, *, timeout_s: float | None = None, ready: Ready | None = None) -> Job:
        """Hand ``item`` to the pipeline without waiting for it to be processed.

        ``ready``: the item enters the pipeline only once this returns (called in a
        worker thread; see the module docstring); if it raises, the job fails.

        Under ``when_full="drop"`` a full entry returns at once with a job that is
        already done and ``dropped``. Under ``"wait"`` it waits for room, at most
        ``timeout_s`` (then the job is ``dropped`` too).

        Raises :class:`~.errors.PipelineClosed` when the pipeline is not running (not
        started, stopping or stopped), also to a submit that was waiting for room when
        :meth:`stop` began; but under ``"drop"`` a full entry refuses the item as above
        whatever the state. Failures in the stages never raise here: they are the job's.
        """
        job = Job(item, self.job_deadline_s)
        with self._lock:
            if self._submitted - self._taken >= self._capacity and not self._wait_for_room(timeout_s):
                self._dropped += 1
                refused = True
            else:
                if self._state is not _State.RUNNING:
                    raise PipelineClosed(f"{self.name} is {self._state.value}; no new items")
                refused = False
                self._submitted += 1
                self._inbox.append((job, ready))
        if refused:
            return self._refuse(job)
        # After the append: the pump raises the flag before its last look at the
        # inbox, so either it sees this job or this sees the flag (an extra wake-up
        # from both seeing is harmless).
        if self._pump_idle:
            self._pump_idle = False
            self._wake_requests.put(True)
        return job

    def _wait_for_room(self, timeout_s: float | None) -> bool:
        """Under the lock, with the inbox full: wait for room if the policy says so."""
        if self.when_full is WhenFull.DROP:
            return False
        self._waiting += 1
        try:
            return self._room.wait_for(
                lambda: self._submitted - self._taken < self._capacity or self._state is not _State.RUNNING,
                timeout_s,
            )
        finally:
            self._waiting -= 1

    def _refuse(self, job: Job) -> Job:
        job.complete(Outcome.DROPPED)
        self._hand_back(job)
        return job

    # -- completed jobs -----------------------------------------------------

    def completed(self) -> list[Job]:
        """Every job completed since the last call (never blocks)."""
        jobs: list[Job] = []
        while True:
            try:
                jobs.append(self._completed.get_nowait())
            except queue.Empty:
                return jobs

    def next_completed(self, timeout_s: float | None = None) -> Job | None:
        """The next completed job, waiting at most ``timeout_s``; None on timeout (never raises)."""
        try:
            return self._completed.get(timeout=timeout_s)
        except queue.Empty:
            return None

    # -- observability ------------------------------------------------------

    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def submitted(self) -> int:
        return self._submitted

    @property
    def queued(self) -> int:
        """Items submitted but not yet in the pipeline's entry queue."""
        return self._submitted - self._taken

    def metrics(self) -> dict[str, StageSnapshot]:
        """Per-stage snapshots, read on the calling thread: never waits for the loop.

        Each figure is a counter the loop updates or a copy made in one C call
        (a stage's recent durations, a queue's length), whole under the interpreter
        lock, so no hop to the loop is needed, and none is made: an inference
        engine's step thread reads these, and waiting until a loop run nicer than
        the engine got a CPU stalled its step up to 18.5 ms on a busy 2-core engine.
        Figures of two stages may be a few items apart.
        """
        pipeline = self._pipeline
        return {} if pipeline is None else pipeline.metrics()

    def outcomes(self) -> dict[str, int]:
        """How many jobs ended with each outcome, refusals at the entry included.

        Raises TimeoutError when the running loop does not read the counts within 5 s.
        """
        pipeline = self._pipeline
        outcomes: dict[Outcome, int] = (
            {} if pipeline is None else self._read(lambda: dict(pipeline.jobs.outcomes))
        )
        counts = {str(k): v for k, v in outcomes.items()}
        if self._dropped:
            counts[Outcome.DROPPED.value] = counts.get(Outcome.DROPPED.value, 0) + self._dropped
        return counts

    # -- the loop thread ----------------------------------------------------

    def _thread_main(self) -> None:
        lower_this_thread(self.nice)  # before anyio starts worker threads: they inherit it
        try:
            anyio.run(self._main, backend="asyncio")
        except BaseException as exc:  # the thread must not die silently
            if self._started.is_set():
                log.error("pipeline thread failed", pipeline=self.name, error=f"{type(exc).__name__}: {exc}")
            else:
                self._startup_error = exc  # raised by start()
        finally:
            self._wake_requests.put(False)
            self._end_leftovers()
            self._started.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = anyio.Event()
        self._stop_requested = anyio.Event()
        on_done = self._hand_back if self._keep_completed else None
        async with Pipeline(self.graph, name=self.name, on_job_done=on_done) as pipeline:
            self._pipeline = pipeline
            async with anyio.create_task_group() as pumps:
                pump_done = anyio.Event()
                pumps.start_soon(self._pump, pipeline, pump_done)
                self._started.set()
                await self._stop_requested.wait()
                self._wake()
                deadline = math.inf if self._drain_deadline_s is None else self._drain_deadline_s
                with anyio.move_on_after(deadline):
                    await pump_done.wait()
                    await pipeline.close()
                    self._drained = True
                pumps.cancel_scope.cancel()
            if not self._drained:
                pipeline.cancel()

    async def _pump(self, pipeline: Pipeline, done: anyio.Event) -> None:
        """Move submitted jobs into the pipeline's entry queue, waiting for room there."""
        waited: tuple[Ready, str | None] | None = None  # the last ready called, and what it raised
        try:
            while True:
                while self._inbox:
                    job, ready = self._inbox.popleft()
                    try:
                        error = None
                        if ready is not None:
                            if waited is None or waited[0] is not ready:
                                waited = (ready, await _wait_for(ready))
                            error = waited[1]
                        if error is not None:
                            self._fail(job, f"the item never became ready: {error}")
                        else:
                            await pipeline.submit_job(job)
                    finally:  # taken even when a cancelled stop interrupts the hand-over
                        # Count it taken first, then look for waiters: a submit that
                        # found the inbox full registered as waiting before it checked
                        # the count again, so one of the two always sees the other.
                        self._taken += 1
                    # Wake blocked submitters once half the inbox is free, not per
                    # item: one wake-up per item is a GIL hand-off per item.
                    if self._waiting and self._submitted - self._taken <= self._capacity // 2:
                        with self._lock:
                            self._room.notify_all()
                if self._stop_requested is not None and self._stop_requested.is_set():
                    return
                self._pump_idle = True
                if self._inbox:  # appended before the flag was up (see submit)
                    self._pump_idle = False
                    continue
                assert self._wakeup is not None
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
        finally:
            done.set()

    def _waker_main(self) -> None:
        lower_this_thread(self.nice)
        while self._wake_requests.get():
            self._call_soon(self._wake)

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _request_stop(self) -> None:
        assert self._stop_requested is not None
        self._stop_requested.set()

    def _end_leftovers(self) -> None:
        """Jobs accepted but never handed to the pipeline end as failed."""
        with self._lock:
            self._state = _State.STOPPED
            self._room.notify_all()
            leftovers = [job for job, _ in self._inbox]
            self._inbox.clear()
            self._taken += len(leftovers)  # the pump is gone: nothing waits in the inbox
        for job in leftovers:
            self._fail(job, "pipeline stopped before the item was processed")

    def _fail(self, job: Job, error: str) -> None:
        """End a job that never entered the pipeline as failed, and hand it back."""
        job.record_failure(error, units=0)
        job.complete(Outcome.FAILED)
        self._hand_back(job)

    def _hand_back(self, job: Job) -> None:
        if self._keep_completed:
            self._completed.put(job)

    def _call_soon(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:  # the loop closed in between: nothing left to wake
                pass

    def _read(self, fn: Callable[[], R]) -> R:
        """Run ``fn`` where the pipeline's state is safe to read: on its loop, or here once it ended."""
        if self._thread is not None and self._thread.is_alive():
            return self._call_on_loop(fn)
        return fn()

    def _call_on_loop(self, fn: Callable[[], R], timeout_s: float = 5.0) -> R:
        future: concurrent.futures.Future[R] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._call_soon(run)
        return future.result(timeout_s)


async def _wait_for(ready: Ready) -> str | None:
    """Call ``ready`` in a worker thread (it blocks); what it raised, as text, or None.

    A stop does not interrupt it: ``ready`` waits on work already under way.
    """
    try:
        await anyio.to_thread.run_sync(ready)
    except Exception as exc:  # noqa: BLE001 - any failure is the item's, not the pump's
        return f"{type(exc).__name__}: {exc}"
    return None
