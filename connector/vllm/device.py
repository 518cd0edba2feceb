"""Where the staging copies run: host memory, or an accelerator's side stream.

The staging area (:mod:`.staging_area`) moves a step's blocks with a handful of
batched calls; this module is the seam that says what each call does on the
cache's device, so the area's code is the same everywhere and a test can stand
in for a device (``tests/connector/vllm/device_double.py``) to count launches and waits.

Why a side stream on a device: the engine thread must never block on the GPU.
Copies are queued on a stream of their own, ordered after the work the engine
has queued (its forward, which wrote the blocks), and a :class:`Fence` recorded
after them says when they are done: whoever reads the slots (the save
pipeline, in a thread of its own) waits on the fence, never the engine thread.
Where the engine's next forward must see a copy (a load into its blocks) or must
not overwrite a block before it was read (a save), the engine's stream waits
on the fence on the device (``wait_event``): the CPU goes on at once.

On a CPU cache the same holds with a thread for a stream: a save's gathers run on
a copy thread of its own (:class:`HostThreadDevice`), so the engine thread goes on
to its next step while they copy, and waits for them (:meth:`Device.before_engine`)
only at the start of its next step, before anything there may overwrite a block
they read, and only if they are not done by then. That thread runs torch with one
OpenMP thread: a parallel region started off the engine's thread would give the
process a second OpenMP pool, and every forward would then sleep at its barriers.

Only device-agnostic torch is used (``torch.Stream``, ``torch.Event``,
``torch.accelerator``), so importing this needs no CUDA build.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import structlog
import torch

from kvpipe.stages.torch_threads import PER_THREAD_TEAMS, single_threaded_torch

log = structlog.get_logger(__name__)


class Fence(Protocol):
    """The point in a device's queue after the copies launched so far."""

    def done(self) -> bool:
        """Whether the copies before it have finished (never blocks)."""
        ...

    def wait(self) -> None:
        """Block until they have: only for threads other than the engine's."""
        ...


class Device(Protocol):
    """The calls the staging area makes; each copy call is one launch, whatever it moves.

    ``host``: the cache is host memory, so slots are filled straight from (and
    copied straight into) its blocks, with no scratch buffer or transfer between.
    Tensors are uint8; ``gather`` and ``scatter`` index dimension 1 of
    ``[regions, rows, bytes]`` views.
    """

    host: bool

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """``ids`` as an int64 index on the device (its upload ordered before the copies that use it)."""
        ...

    def scratch(self, rows: int, width: int) -> torch.Tensor:
        """A ``[rows, width]`` buffer on the device, safe to use for the copies that follow."""
        ...

    def after_engine(self) -> None:
        """Order the copies launched from now on after the work the engine has queued."""
        ...

    def gather(self, out: torch.Tensor, source: torch.Tensor, index: torch.Tensor) -> None:
        """``out[:, i] = source[:, index[i]]``."""
        ...

    def scatter(self, target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
        """``target[:, index[i]] = source[:, i]``."""
        ...

    def transfer(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target[:] = source`` between host and device memory."""
        ...

    def record(self, *, engine_waits: bool) -> Fence:
        """A fence after the copies launched so far; ``engine_waits``: the engine's next work waits for it."""
        ...

    def before_engine(self) -> float:
        """Called on the engine thread before its next step's work: block until that work may run.

        Only a device whose copies run on a host thread waits here (for the
        copies recorded with ``engine_waits``); a stream orders them on the device.
        Returns the seconds the calling thread waited (0.0: none).
        """
        ...

    def close(self) -> None:
        """Finish the copies under way and let go of what runs them; idempotent."""
        ...


class _Done:
    """The fence of copies that finished before their call returned."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE: Fence = _Done()


class HostDevice:
    """A cache in host memory: plain torch calls on the calling thread, done on return."""

    host = True

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64)

    def scratch(self, rows: int, width: int) -> torch.Tensor:
        return torch.empty((rows, width), dtype=torch.uint8)

    def after_engine(self) -> None:
        return None  # the forward that wrote the blocks has returned

    def gather(self, out: torch.Tensor, source: torch.Tensor, index: torch.Tensor) -> None:
        torch.index_select(source, 1, index, out=out)

    def scatter(self, target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
        # On CPU, index_copy_ along the block dimension copies element by element: 161 MB
        # (77 blocks of 16 regions of 128 KiB) took 68 ms, against 13 ms as one copy_ per
        # block, which moves whole rows (index_select, the gather, takes 12 ms).
        for position, block in enumerate(index.tolist()):
            target[:, block].copy_(source[:, position])

    def transfer(self, target: torch.Tensor, source: torch.Tensor) -> None:
        target.copy_(source)

    def record(self, *, engine_waits: bool) -> Fence:
        return DONE

    def before_engine(self) -> float:
        return 0.0

    def close(self) -> None:
        return None


class _HostFence:
    """A point in the copy thread's queue: done once the thread has run every copy queued before it."""

    def __init__(self) -> None:
        self._reached = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._reached.is_set()

    def reach(self, error: BaseException | None) -> None:
        self.error = error
        self._reached.set()

    def join(self) -> None:
        """Block until it is reached, whatever the copies before it did."""
        self._reached.wait()

    def wait(self) -> None:
        """Block until it is reached. Raises RuntimeError if a copy before it failed: its slots are not to be read."""
        self._reached.wait()
        if self.error is not None:
            raise RuntimeError(f"a staging copy failed: {self.error!r}") from self.error


class HostThreadDevice(HostDevice):
    """A cache in host memory, a save's gathers on a copy thread of its own, as a stream would run them.

    A step's gathers copy its blocks into the slots while the engine thread
    goes on (``copy_in`` returns at once); the save pipeline waits on their fence
    before a put reads the slots, and the engine thread waits for them in
    :meth:`before_engine`, at its next step's start, before it may overwrite a
    block they read. A load's scatter stays on the calling thread: the engine
    reads its blocks right after. Only where a thread can have an OpenMP team
    of its own (:data:`~kvpipe.stages.torch_threads.PER_THREAD_TEAMS`, which
    :func:`device_of` checks), so the copy thread starts no OpenMP pool.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], object] | _HostFence | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._engine_fence: _HostFence | None = None

    def submit(self, copy: Callable[[], object]) -> None:
        """Run ``copy`` on the copy thread, after everything queued before it."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvpipe-staging-copy", daemon=True)
            self._thread.start()
        self._queue.put(copy)

    def gather(self, out: torch.Tensor, source: torch.Tensor, index: torch.Tensor) -> None:
        self.submit(lambda: torch.index_select(source, 1, index, out=out))

    def record(self, *, engine_waits: bool) -> Fence:
        if self._thread is None:
            return DONE  # nothing was ever queued
        fence = _HostFence()
        self._queue.put(fence)
        if engine_waits:
            self._engine_fence = fence
        return fence

    def before_engine(self) -> float:
        fence, self._engine_fence = self._engine_fence, None
        if fence is None or fence.done():
            return 0.0
        started = time.perf_counter()
        fence.join()
        return time.perf_counter() - started

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        self._engine_fence = None

    def _run(self) -> None:
        if not single_threaded_torch():  # device_of found libgomp's setter; a torch on another OpenMP may ignore it
            log.warning("the staging copy thread runs torch with its OpenMP team: the engine may slow down")
        error: BaseException | None = None  # of the copies between the last fences and the next
        fenced = False  # the last item was a fence: a copy after it starts a new stretch
        while (item := self._queue.get()) is not None:
            if isinstance(item, _HostFence):
                item.reach(error)
                fenced = True
                continue
            if fenced:
                error, fenced = None, False
            try:
                item()
            except BaseException as exc:  # noqa: BLE001 - the thread must live on: fences after it carry it
                error = error or exc


class _EventFence:
    def __init__(self, event: torch.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class AcceleratorDevice:
    """A cache on an accelerator: every copy on one side stream, none of them waited for here.

    Buffers made here (indexes, scratch) are allocated while the side stream is
    current, so the caching allocator reuses their memory only in that stream's
    order: dropping them after the launch is safe without ``record_stream``.
    The index is uploaded from pinned memory: a pageable upload would make the
    thread wait for the side stream, and so for the engine's forward.
    """

    host = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = torch.Stream(device=device)

    def _engine(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        pinned = torch.tensor(ids, dtype=torch.int64).pin_memory()
        with self._side:
            return pinned.to(self.device, non_blocking=True)

    def scratch(self, rows: int, width: int) -> torch.Tensor:
        with self._side:
            return torch.empty((rows, width), dtype=torch.uint8, device=self.device)

    def after_engine(self) -> None:
        self._side.wait_stream(self._engine())

    def gather(self, out: torch.Tensor, source: torch.Tensor, index: torch.Tensor) -> None:
        with self._side:
            torch.index_select(source, 1, index, out=out)

    def scatter(self, target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
        with self._side:
            target.index_copy_(1, index, source)

    def transfer(self, target: torch.Tensor, source: torch.Tensor) -> None:
        with self._side:
            target.copy_(source, non_blocking=True)

    def record(self, *, engine_waits: bool) -> Fence:
        event = torch.Event(device=self.device)
        event.record(self._side)
        if engine_waits:
            self._engine().wait_event(event)
        return _EventFence(event)

    def before_engine(self) -> float:
        return 0.0  # the engine's stream waits on the device (``record``)

    def close(self) -> None:
        return None  # the side stream's copies are fenced; the stream goes with the device


def device_of(device: torch.device) -> Device:
    """The :class:`Device` for a cache on ``device``: on CPU a copy thread, where torch can run one safely."""
    if device.type != "cpu":
        return AcceleratorDevice(device)
    return HostThreadDevice() if PER_THREAD_TEAMS else HostDevice()
