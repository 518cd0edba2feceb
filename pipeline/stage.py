"""What a stage is: one async step of a pipeline, testable on its own.

A stage receives one item at a time (``Stage.process``) or, for a *batch stage*, a
list of items the runtime gathered for it (``BatchStage.process_batch``). It never
sees queues or jobs. Everything it does to the outside world goes through the
:class:`Emit` handle it is given with each item:

``await emit(item, port, released=False)``
    Forward a derived item on one of the stage's named output ports. It is async
    because the downstream queue is bounded: a slow consumer slows the producer.
    ``released=True`` says the item no longer reads memory the submitter lent
    (the stage copied it), so the job can be released before it completes.
``emit.drop(reason)``
    Say that this input is deliberately not forwarded (a filter's "already
    stored"). It is counted, never an error.
``emit.fail(error, units)``
    Record a failure against the input's job without raising, e.g. one object of
    a batch the store refused. Raising from ``process`` also fails the input, and
    the pipeline carries on with the next one.
``emit.succeed(units)``
    Record units of work that finished well (e.g. objects stored), so a job with
    some failures is reported as *partial* rather than *failed*.
``emit.count(name, n)``
    Add to a named counter of the job (e.g. ``"existing"``), reported with it.

The runtime binds each handle to the job of the input it belongs to, so job
accounting needs nothing from stage code. In a batch each entry carries its own
handle, because a batch mixes items of several jobs. A handle is good only until
the call it came with returns: the runtime hands the same object, bound anew, to
the stage's next item.

Blocking work (a store call that waits on the network) goes through
``await self.run_blocking(fn, *args)``: it runs in a worker thread under the
stage's own :class:`anyio.CapacityLimiter`, so one slow stage cannot take every
thread of the process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import anyio

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_PORT = "out"


class Emit(Protocol):
    """The handle through which a stage reports what became of one input item."""

    async def __call__(self, item: Any, port: str = DEFAULT_PORT, *, released: bool = False) -> None: ...

    def drop(self, reason: str) -> None: ...

    def fail(self, error: str | BaseException, units: int = 1) -> None: ...

    def succeed(self, units: int = 1) -> None: ...

    def count(self, name: str, n: int = 1) -> None: ...

    @property
    def expired(self) -> bool:
        """The job's deadline has passed: a stage should fail the item rather than call out for it."""
        ...


@dataclass(frozen=True, slots=True)
class BatchEntry(Generic[T]):
    """One item of a batch together with the handle of the job it belongs to."""

    item: T
    emit: Emit


class _StageBase:
    """What single-item and batch stages share: ports and the thread limiter."""

    #: Output ports. A stage without ports is a sink (the end of a path).
    ports: ClassVar[tuple[str, ...]] = (DEFAULT_PORT,)
    #: Optional declarations the graph checks at build time: the type of item
    #: this stage accepts, and per port the type it emits (``Any``: unchecked).
    input_type: ClassVar[Any] = Any
    output_types: ClassVar[Mapping[str, Any]] = {}
    #: Worker threads this stage may occupy at once for ``run_blocking``.
    thread_limit: int = 1
    #: Set (at build time) when this instance would forward every item unchanged
    #: on its one port, e.g. a feature turned off. The runtime then wires its
    #: producers straight to its consumers: one queue hop less per item.
    passes_through: bool = False
    #: Whether the runtime may run this stage inline in its producer's task when
    #: both take one item at a time with one worker (a fused chain: no queue hop
    #: between them). Opt-in, for a stage that only computes: inline, a stage that
    #: waits (on I/O, on an event) would hold its producer, and the producer's item
    #: would stay unsettled (its job unreleased) until the wait ended.
    fuses: ClassVar[bool] = False

    _limiter: anyio.CapacityLimiter | None = None

    async def start(self) -> None:
        """Called once on the event loop before the first item (open resources)."""

    async def stop(self) -> None:
        """Called once after the last item, also after cancellation."""

    async def run_blocking(self, fn: Callable[..., R], *args: Any) -> R:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.thread_limit)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)


class Stage(_StageBase):
    """A stage that handles one item at a time."""

    async def process(self, item: Any, emit: Emit) -> None:
        raise NotImplementedError


class BatchStage(_StageBase):
    """A stage that handles items in batches gathered by the runtime.

    The runtime flushes a batch when it holds ``max_items`` items or when
    ``max_wait`` seconds have passed since its first item, whichever comes first.
    """

    async def process_batch(self, batch: Sequence[BatchEntry[Any]]) -> None:
        raise NotImplementedError


AnyStage = Stage | BatchStage
