"""A stand-in for an accelerator, on CPU tensors, and a counter of what any device is asked to do.

:class:`DeviceDouble` implements the staging area's :class:`~kvpipe.connector.vllm.device.Device`
the way a GPU behaves at its worst for a careless caller: a launched copy is only
queued (on the double's "side stream"), and runs when someone waits for a fence
after it, or when the engine's next forward (:meth:`DeviceDouble.forward`) reaches
a fence the engine's stream was told to wait on. Code that reads a slot without
waiting, or lets the forward run before a load's copies, sees stale bytes.

Every launch and every blocking wait is counted with the name of the thread it
came from (:class:`CountingDevice`, which also wraps a real accelerator for the
GPU measurement), so a test can say how many launches a step costs and that the
engine thread never blocked.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from kvpipe.connector.vllm.device import Device, Fence


def _thread() -> str:
    return threading.current_thread().name


class _CountedFence:
    def __init__(self, fence: Fence, waits: Counter[str]) -> None:
        self._fence = fence
        self._waits = waits

    def done(self) -> bool:
        return self._fence.done()

    def wait(self) -> None:
        self._waits[_thread()] += 1
        self._fence.wait()


class CountingDevice:
    """``inner``, counted: ``launches`` and ``waits`` per thread name (an index upload is a launch)."""

    def __init__(self, inner: Device) -> None:
        self.inner = inner
        self.host = inner.host
        self.launches: Counter[str] = Counter()
        self.waits: Counter[str] = Counter()

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        self.launches[_thread()] += 1
        return self.inner.index(ids)

    def scratch(self, rows: int, width: int) -> torch.Tensor:
        return self.inner.scratch(rows, width)

    def after_engine(self) -> None:
        self.inner.after_engine()

    def gather(self, out: torch.Tensor, source: torch.Tensor, index: torch.Tensor) -> None:
        self.launches[_thread()] += 1
        self.inner.gather(out, source, index)

    def scatter(self, target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
        self.launches[_thread()] += 1
        self.inner.scatter(target, index, source)

    def transfer(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self.launches[_thread()] += 1
        self.inner.transfer(target, source)

    def record(self, *, engine_waits: bool) -> Fence:
        return _CountedFence(self.inner.record(engine_waits=engine_waits), self.waits)

    def before_engine(self) -> float:
        return self.inner.before_engine()

    def close(self) -> None:
        self.inner.close()


class _QueuedFence:
    """A point in the lazy device's queue: done once every copy queued before it has run."""

    def __init__(self, device: _LazyDevice, position: int) -> None:
        self._device = device
        self._position = position

    def done(self) -> bool:
        return self._device.ran >= self._position

    def wait(self) -> None:
        self._device.run_until(self._position)


class _LazyDevice:
    """CPU tensors behind a device's interface; copies run only when something waits past them."""

    host = False

    def __init__(self) -> None:
        self.ran = 0  # how many queued copies have run
        self._queue: list[Callable[[], object]] = []
        self._engine_waits_for = 0  # the queue position the engine's next forward waits for
        self._lock = threading.Lock()

    def _launch(self, copy: Callable[[], object]) -> None:
        with self._lock:
            self._queue.append(copy)

    def run_until(self, position: int) -> None:
        """Run the queued copies up to ``position`` (what the device would have done by then)."""
        with self._lock:
            while self.ran < position:
                self._queue[self.ran]()
                self.ran += 1

    def forward(self) -> None:
        self.run_until(self._engine_waits_for)

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64)  # an upload done at once: nothing reads it early

    def scratch(self, rows: int, width: int) -> torch.Tensor:
        return torch.full((rows, width), 0xEE, dtype=torch.uint8)  # not zeros: a stale read shows

    def after_engine(self) -> None:
        return None  # the engine's work on CPU tensors is done when the test calls in

    def gather(self, out: torch.Tensor, source: torch.Tensor, index: torch.Tensor) -> None:
        self._launch(lambda: torch.index_select(source, 1, index, out=out))

    def scatter(self, target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
        self._launch(lambda: target.index_copy_(1, index, source))

    def transfer(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self._launch(lambda: target.copy_(source))

    def record(self, *, engine_waits: bool) -> Fence:
        with self._lock:
            position = len(self._queue)
        if engine_waits:
            self._engine_waits_for = max(self._engine_waits_for, position)
        return _QueuedFence(self, position)

    def before_engine(self) -> float:
        return 0.0  # as a stream: the forward waits on the device (:meth:`forward`)

    def close(self) -> None:
        return None


class DeviceDouble(CountingDevice):
    """A counted device whose copies run only when a fence is waited for or the next forward needs them."""

    def __init__(self) -> None:
        self._lazy = _LazyDevice()
        super().__init__(self._lazy)

    def forward(self) -> None:
        """The engine's next forward: it starts once the fences its stream waits on are passed."""
        self._lazy.forward()
