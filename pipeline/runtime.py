"""Running a graph: bounded queues, workers, drain and cancellation.

Each stage has one inbox, a bounded anyio memory object stream; every edge into
the stage sends into it, so back-pressure reaches all the way to ``submit``: when
the put stage is slow, the filter's emits wait, then the collect stages', then the
entry. Nothing queues without a bound.

Each producer worker holds its own clone of every downstream send stream. When the
entry closes, the entry stage's workers finish their items and exit, their clones
close, the next stage sees end-of-stream once all its producers are gone, and so
on: closing drains the graph in topological order without a coordinator.

Adjacent stages that compute run as one task where nothing is lost by it (a
*fused chain*): a single-worker, single-item stage whose every producer runs in
the task of one single-worker, single-item stage is called inline from that
task's emits instead of through an inbox. A queue hop costs a send, a receive
and usually a task switch per item; a fused stage costs a call. Ordering and
back-pressure are what the queue gave with one worker at each end, and job
accounting and per-stage metrics are unchanged (a stage's processing time
excludes what its fused consumers took). Only a stage that says it only computes
is fused (:attr:`~.stage.Stage.fuses`): one that waits would hold its producer.

A stage that raises fails only the item it was given (its job records the error,
the stage's error counter goes up) and the worker takes the next item. Cancelling
the pipeline stops every worker at once and ends every open job as failed, so a
caller waiting for jobs is never left hanging.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Self

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .errors import PipelineClosed
from .graph import Graph, StageSpec
from .jobs import Job, JobTracker, Outcome, checked_deadline
from .metrics import StageMetrics, StageSnapshot
from .stage import DEFAULT_PORT, BatchEntry, BatchStage, Stage

log = structlog.get_logger("kvpipe.pipeline")

#: (job, item, borrows): ``borrows`` says the item may read what the submitter lent
Envelope = tuple[Job, Any, bool]
SendStream = MemoryObjectSendStream[Envelope]
ReceiveStream = MemoryObjectReceiveStream[Envelope]

#: Where a port's items go: the inboxes of the stages it feeds, or those stages run inline.
Outs = dict[str, list["SendStream | _Fused"]]

#: A worker that always finds its inbox non-empty yields to the loop this often,
#: so a busy stage cannot starve the others (receive_nowait never yields).
_YIELD_EVERY = 64
#: A single-item worker times one item in this many through its stage and the stages
#: fused to it: a stage's duration percentiles are over a sample of its items (a
#: window of them still spans thousands), and the others pay no clock reads.
_TIME_EVERY = 8


class _Emit:
    """The :class:`~kvpipe.pipeline.stage.Emit` handle of one stage, bound to one input item at a time.

    Bound as the stage is handed the item (:meth:`begin`, which counts it in) and
    closed when the stage returns. A fused chain binds one per stage per item, so
    this is the runtime's hottest code: profile before adding to it.
    """

    __slots__ = ("_node", "_job", "_outs", "_borrows", "_timed", "_started", "acted", "inline_s")

    def __init__(self, node: _Node, outs: Outs) -> None:
        self._node = node
        self._outs = outs

    def begin(self, job: Job, borrows: bool, timed: bool) -> _Emit:
        """Hand the stage an item of ``job`` (which counts it in); returns the handle.

        A worker and a fused stage reuse one handle for every item they process, one
        at a time (a batch makes one per entry): making one per stage per item cost a
        sixth of a fused chain's time, and the allocations ran the garbage collector.
        """
        self._node.metrics.items_in += 1
        self._job = job
        self._borrows = borrows
        self._timed = timed  # the item is one its worker times: so are its fused consumers' calls
        self._started = time.perf_counter() if timed else 0.0
        self.acted = False  # emitted, dropped, failed or succeeded anything
        self.inline_s = 0.0  # time fused consumers took inside this item's emits
        return self

    async def __call__(self, item: Any, port: str = DEFAULT_PORT, *, released: bool = False) -> None:
        try:
            targets = self._outs[port]
        except KeyError:
            raise ValueError(f"stage {self._node.name!r} has no output port {port!r}") from None
        self.acted = True
        job = self._job
        borrows = self._borrows and not released
        for send in targets:
            if isinstance(send, _Fused):
                # Inline, this item's own pending count covers the consumer's work, and
                # its borrow outlasts the consumer's: the job's counts need no update.
                # What a worker does per item, written out: a call to a shared
                # coroutine here cost a tenth of a fused chain's time per item.
                emit = send.emit.begin(job, borrows, self._timed)
                try:
                    await send.stage.process(item, emit)
                except Exception as exc:
                    _item_raised(send.node, job, exc)
                self.inline_s += emit.close()
                continue
            job.pending += 1
            if borrows:
                job.borrowing += 1
            envelope = (job, item, borrows)
            try:
                send.send_nowait(envelope)
            except anyio.WouldBlock:
                try:
                    await send.send(envelope)
                except BaseException:
                    job.pending -= 1
                    raise  # the job ends as cancelled, which releases it whatever ``borrowing`` says
        self._node.metrics.items_out += 1

    def close(self) -> float:
        """The stage is done with the item; returns the seconds it took when timed (else 0).

        A timed item's duration goes to the stage's metrics without what its fused
        consumers took; a sink that took the item without complaint succeeded a unit.
        """
        took = 0.0
        if self._timed:
            took = time.perf_counter() - self._started
            self._node.metrics.durations.append(took - self.inline_s)
        if not self.acted and self._node.is_sink:
            self._job.succeeded_units += 1
        return took

    def drop(self, reason: str) -> None:
        self.acted = True
        self._job.dropped_items += 1
        self._job.counts["dropped"] += 1
        self._node.metrics.dropped += 1

    def fail(self, error: str | BaseException, units: int = 1) -> None:
        self.acted = True
        self._job.record_failure(error, units)
        self._node.metrics.errors += 1
        # Debug only: a stage reports expected failures (a refused object) in bulk,
        # and they reach the job and the stage's error counter anyway.
        log.debug("item failed", stage=self._node.name, job=self._job.id, error=str(error))

    def succeed(self, units: int = 1) -> None:
        self.acted = True
        self._job.succeeded_units += units

    def count(self, name: str, n: int = 1) -> None:
        self._job.counts[name] += n

    @property
    def expired(self) -> bool:
        return self._job.expired


@dataclass(slots=True)
class _Node:
    spec: StageSpec
    inbox_send: SendStream
    inbox: ReceiveStream
    metrics: StageMetrics
    #: A stage without ports: an item it takes without complaint is a unit that succeeded.
    is_sink: bool = field(init=False)

    def __post_init__(self) -> None:
        self.is_sink = not self.spec.stage.ports

    @property
    def name(self) -> str:
        return self.spec.name


class Pipeline:
    """A running graph. Use as ``async with Pipeline(graph) as p: job = await p.submit(x)``.

    Leaving the block normally closes the entry and waits for the graph to drain;
    leaving it with an exception cancels the workers. Either way every job ends.

    Raises ValueError when ``job_deadline_s`` is given and not > 0.
    """

    def __init__(
        self,
        graph: Graph,
        *,
        name: str = "pipeline",
        on_job_done: Callable[[Job], None] | None = None,
        job_deadline_s: float | None = None,
    ) -> None:
        self.job_deadline_s = checked_deadline(job_deadline_s)
        self.graph = graph
        self.name = name
        self.jobs = JobTracker(on_complete=on_job_done)
        self._nodes: dict[str, _Node] = {}
        for spec in graph.specs:
            send, receive = anyio.create_memory_object_stream[Envelope](spec.capacity)
            metrics = StageMetrics(spec.name, queue_depth=_depth_of(receive))
            self._nodes[spec.name] = _Node(spec, send, receive, metrics)
        self._entry = self._nodes[graph.entry].inbox_send
        self._task_of = self._tasks()
        self._running: AsyncExitStack | None = None  # the task group the workers run in, entered
        self._workers_scope = anyio.CancelScope()
        self._stopped = anyio.Event()  # the workers are gone, drained or cancelled
        self._drained = False
        self._closing = False
        self.submitted = 0

    # -- lifecycle ----------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Start every stage (:meth:`Stage.start`) in graph order, then the workers.

        What a stage's ``start`` raises propagates, once the stages started before it are stopped.
        """
        await self._start_stages()
        async with AsyncExitStack() as stack:  # left at once (the task group exited) if the start raises
            task_group = await stack.enter_async_context(anyio.create_task_group())
            await task_group.start(self._run)
            self._running = stack.pop_all()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool | None:
        assert self._running is not None
        if exc_type is None:
            await self.close()
        else:
            self.cancel()
        return await self._running.__aexit__(exc_type, exc, tb)

    async def close(self) -> None:
        """Stop accepting items and wait until everything queued is processed."""
        self._closing = True
        await self._entry.aclose()
        await self._stopped.wait()

    async def drain(self, deadline_s: float | None) -> bool:
        """Close, wait at most ``deadline_s`` for the drain, then cancel. True if drained."""
        with anyio.move_on_after(math.inf if deadline_s is None else deadline_s):
            await self.close()
        if not self._stopped.is_set():
            self.cancel()
            await self._stopped.wait()
        return self._drained

    def cancel(self) -> None:
        """Stop every worker now; open jobs end as failed ("cancelled")."""
        self._closing = True
        self._workers_scope.cancel()

    # -- submitting ---------------------------------------------------------

    async def submit(self, item: Any) -> Job:
        """Queue ``item`` at the entry, waiting while the entry queue is full.

        Raises :class:`~.errors.PipelineClosed` when :meth:`close`, :meth:`drain` or
        :meth:`cancel` was called, leaving the block included (no job is opened), or when
        the entry turns out to be closed or its workers gone (the item's job then ends
        as failed). A cancellation while waiting for room ends the job as failed too,
        and propagates.
        """
        if self._closing:
            raise PipelineClosed(f"{self.name} is closing; no new items")
        job = Job(item, self.job_deadline_s)
        self._adopt(job)
        try:
            try:
                # No checkpoint when there is room: a burst of submits fills the
                # entry queue before the workers run, and they then take items
                # in runs instead of waking once per item.
                self._entry.send_nowait((job, item, True))
            except anyio.WouldBlock:
                await self._entry.send((job, item, True))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.jobs.end(job, Outcome.FAILED, "pipeline closed")
            raise PipelineClosed(f"{self.name} is closed") from None
        except BaseException:
            self.jobs.end(job, Outcome.FAILED, "cancelled while submitting")
            raise
        return job

    def _adopt(self, job: Job) -> None:
        """Track ``job`` from now on: its work counts until it ends."""
        self.submitted += 1
        self.jobs.open(job)

    async def submit_job(self, job: Job) -> None:
        """Track and queue a job created elsewhere (the sync bridge creates jobs off the loop).

        Raises nothing of its own: a closed entry fails the job instead. A cancellation
        while waiting for room propagates, and the job stays open until the pipeline
        ends it (failed, ``"cancelled"``).
        """
        self._adopt(job)
        try:
            try:
                self._entry.send_nowait((job, job.item, True))
            except anyio.WouldBlock:
                await self._entry.send((job, job.item, True))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.jobs.end(job, Outcome.FAILED, "pipeline closed")

    # -- observability ------------------------------------------------------

    def metrics(self) -> dict[str, StageSnapshot]:
        return {
            name: node.metrics.snapshot(
                passes_through=self._passes_through(name), fused=self._task_of.get(name, name) != name
            )
            for name, node in self._nodes.items()
        }

    # -- the workers --------------------------------------------------------

    async def _start_stages(self) -> None:
        """Start every stage in graph order; if one fails, stop those started and raise."""
        for index, name in enumerate(self.graph.order):
            try:
                await self._nodes[name].spec.stage.start()
            except BaseException:
                await self._stop_stages(self.graph.order[:index])
                raise

    async def _stop_stages(self, names: tuple[str, ...]) -> None:
        with anyio.CancelScope(shield=True):
            for name in reversed(names):
                await self._nodes[name].spec.stage.stop()

    async def _run(self, *, task_status: TaskStatus[None]) -> None:
        try:
            # The workers' own scope: cancelling it must not cancel the caller's
            # task, which runs inside the outer task group's scope.
            with self._workers_scope:
                async with anyio.create_task_group() as workers:
                    self._start_workers(workers)
                    task_status.started()
            self._drained = not self._workers_scope.cancel_called
        finally:
            ended = self.jobs.end_all(Outcome.FAILED, "cancelled")
            if ended:
                log.warning("pipeline cancelled with open jobs", pipeline=self.name, jobs=ended)
            await self._stop_stages(self.graph.order)
            self._stopped.set()

    def _start_workers(self, workers: TaskGroup) -> None:
        tasks = self._task_of
        for name in self.graph.order:
            node = self._nodes[name]
            if self._passes_through(name) or tasks[name] != name:
                continue  # wired around, or run inline by its producer's task
            for _ in range(node.spec.workers):
                outs = self._outs(name, tasks)
                run = self._run_batch_worker if node.spec.is_batch else self._run_worker
                workers.start_soon(run, node, node.inbox.clone(), outs, name=f"{self.name}.{name}")
        # The workers hold clones now: each stream ends when its last holder exits.
        for node in self._nodes.values():
            if node.name != self.graph.entry:
                node.inbox_send.close()
            node.inbox.close()

    def _outs(self, name: str, tasks: dict[str, str]) -> Outs:
        """Per port of ``name``: a clone of each receiver's inbox, or the receiver itself if fused."""
        return {
            port: [
                self._nodes[target].inbox_send.clone()
                if tasks[target] == target
                else _Fused(self._nodes[target], self._outs(target, tasks))
                for target in self._receivers(name, port)
            ]
            for port in self._nodes[name].spec.stage.ports
        }

    def _tasks(self) -> dict[str, str]:
        """Per stage that runs, the stage whose workers run it: itself, or the head of its fused chain.

        A stage is fused when it is single-item, has one worker, says it may be, and
        every producer runs in the task of one single-item, single-worker stage: its
        items then arrive one at a time, in order, as its inbox would have given them.
        """
        producers: dict[str, list[str]] = {}
        for name in self.graph.order:
            if not self._passes_through(name):
                for port in self._nodes[name].spec.stage.ports:
                    for target in self._receivers(name, port):
                        producers.setdefault(target, []).append(name)
        tasks: dict[str, str] = {}
        for name in self.graph.order:
            if self._passes_through(name):
                continue
            spec = self._nodes[name].spec
            heads = {tasks[producer] for producer in producers.get(name, ())}
            head = heads.pop() if len(heads) == 1 else None
            fused = (
                head is not None
                and _runs_alone(spec)
                and spec.stage.fuses
                and _runs_alone(self._nodes[head].spec)
            )
            tasks[name] = head if fused and head is not None else name
        return tasks

    def _passes_through(self, name: str) -> bool:
        """Whether the runtime wires ``name`` around; the entry always runs (submitters send to it)."""
        return name != self.graph.entry and self._nodes[name].spec.stage.passes_through

    def _receivers(self, name: str, port: str) -> list[str]:
        """The stages that receive what ``name`` emits on ``port``, past stages that pass through."""
        receivers = []
        for target in self.graph.targets(name, port):
            if self._passes_through(target):
                receivers.extend(self._receivers(target, DEFAULT_PORT))
            else:
                receivers.append(target)
        return receivers

    async def _run_worker(self, node: _Node, inbox: ReceiveStream, outs: Outs) -> None:
        stage = node.spec.stage
        assert isinstance(stage, Stage)
        settle = self.jobs.settle
        with inbox, _closing_all(outs):
            since_yield = 0
            until_timed = 0
            handle = _Emit(node, outs)
            while True:
                try:
                    job, item, borrows = inbox.receive_nowait()
                    since_yield += 1
                    if since_yield >= _YIELD_EVERY:
                        since_yield = 0
                        await anyio.lowlevel.checkpoint()
                except anyio.WouldBlock:
                    try:
                        job, item, borrows = await inbox.receive()
                    except anyio.EndOfStream:
                        return
                except anyio.EndOfStream:
                    return
                timed = not until_timed  # the first item, then one in _TIME_EVERY
                until_timed = until_timed - 1 if until_timed else _TIME_EVERY - 1
                emit = handle.begin(job, borrows, timed)
                try:
                    await stage.process(item, emit)
                except Exception as exc:
                    _item_raised(node, job, exc)
                emit.close()
                settle(job, borrows)

    async def _run_batch_worker(self, node: _Node, inbox: ReceiveStream, outs: Outs) -> None:
        stage = node.spec.stage
        assert isinstance(stage, BatchStage)
        policy = node.spec.batch_policy
        metrics = node.metrics
        with inbox, _closing_all(outs):
            while True:
                try:
                    batch = [await inbox.receive()]
                except anyio.EndOfStream:
                    return
                await _gather(inbox, batch, policy.max_items, policy.max_wait_s)
                # Untimed: the batch's call is timed as one.
                emits = [_Emit(node, outs).begin(job, borrows, timed=False) for job, _, borrows in batch]
                started = time.perf_counter()
                try:
                    await stage.process_batch(
                        [BatchEntry(item, emit) for (_, item, _), emit in zip(batch, emits, strict=True)]
                    )
                except Exception as exc:
                    for job, _, _ in batch:
                        _item_raised(node, job, exc)
                finally:
                    metrics.durations.append(time.perf_counter() - started)
                for (job, _, borrows), emit in zip(batch, emits, strict=True):
                    emit.close()
                    self.jobs.settle(job, borrows)


def _item_raised(node: _Node, job: Job, exc: Exception) -> None:
    """A stage raised on ``job``'s item: it fails that item only."""
    node.metrics.errors += 1
    job.record_failure(exc)
    log.warning("stage raised", stage=node.name, job=job.id, error=f"{type(exc).__name__}: {exc}")


async def _gather(inbox: ReceiveStream, batch: list[Envelope], max_items: int, max_wait_s: float) -> None:
    """Add to ``batch`` what is queued now, then wait up to ``max_wait_s`` for more."""
    deadline = anyio.current_time() + max_wait_s
    while len(batch) < max_items:
        try:
            batch.append(inbox.receive_nowait())
            continue
        except anyio.WouldBlock:
            pass
        except anyio.EndOfStream:
            return
        remaining = deadline - anyio.current_time()
        if remaining <= 0:
            return
        with anyio.move_on_after(remaining):
            try:
                batch.append(await inbox.receive())
            except anyio.EndOfStream:
                return


class _Fused:
    """A stage run inline by its producer's task (a fused chain): the target of an emit, like an inbox."""

    __slots__ = ("node", "stage", "outs", "emit")

    def __init__(self, node: _Node, outs: Outs) -> None:
        stage = node.spec.stage
        assert isinstance(stage, Stage)  # only single-item stages are fused
        self.node = node
        self.stage = stage
        self.outs = outs
        self.emit = _Emit(node, outs)  # its producer's task runs it one item at a time


def _runs_alone(spec: StageSpec) -> bool:
    """Whether ``spec``'s items go through one ``process`` call at a time (single-item, one worker)."""
    return not spec.is_batch and spec.workers == 1


class _closing_all:
    """Close every send stream of ``outs`` on exit (fused stages' too), so downstream sees end-of-stream."""

    def __init__(self, outs: Outs) -> None:
        self._outs = outs

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        for sends in self._outs.values():
            for send in sends:
                if isinstance(send, _Fused):
                    _closing_all(send.outs).__exit__()
                else:
                    send.close()


def _depth_of(receive: ReceiveStream) -> Callable[[], int]:
    return lambda: receive.statistics().current_buffer_used
