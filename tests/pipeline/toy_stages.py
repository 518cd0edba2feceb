"""Small stages the framework tests wire together."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import anyio

from kvpipe.pipeline import BatchEntry, BatchStage, Emit, Graph, Stage, StageSpec


class AddOne(Stage):
    async def process(self, item: int, emit: Emit) -> None:
        await emit(item + 1)


class Collect(Stage):
    """A sink that remembers what reached it."""

    ports = ()

    def __init__(self) -> None:
        self.items: list[Any] = []

    async def process(self, item: Any, emit: Emit) -> None:
        self.items.append(item)


class Slow(Stage):
    """Forwards each item after ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def process(self, item: Any, emit: Emit) -> None:
        await anyio.sleep(self.delay_s)
        await emit(item)


class Gate(Stage):
    """Holds every item until ``open`` is set."""

    ports = ()

    def __init__(self) -> None:
        self.open = anyio.Event()
        self.entered = 0

    async def process(self, item: Any, emit: Emit) -> None:
        self.entered += 1
        await self.open.wait()


class ThreadGate(Stage):
    """Holds every item until a (thread-safe) event is set, from any thread."""

    ports = ()

    def __init__(self, event: Any) -> None:
        self.event = event

    async def process(self, item: Any, emit: Emit) -> None:
        while not self.event.is_set():
            await anyio.sleep(0.005)


class Fn(Stage):
    """Calls ``fn(item, emit)``: for one-off behaviours in a single test."""

    def __init__(self, fn: Callable[[Any, Emit], Any], ports: Sequence[str] = ("out",)) -> None:
        self.fn = fn
        self.ports = tuple(ports)  # type: ignore[misc]

    async def process(self, item: Any, emit: Emit) -> None:
        result = self.fn(item, emit)
        if hasattr(result, "__await__"):
            await result


class RecordBatches(BatchStage):
    """Forwards every item and remembers batch sizes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    async def process_batch(self, batch: Sequence[BatchEntry[Any]]) -> None:
        self.sizes.append(len(batch))
        for entry in batch:
            await entry.emit(entry.item)


class Typed(Stage):
    input_type: ClassVar[Any] = int
    output_types: ClassVar[dict[str, Any]] = {"out": str}

    async def process(self, item: int, emit: Emit) -> None:
        await emit(str(item))


def chain(*stages: Stage | BatchStage, capacity: int = 64) -> Graph:
    """A linear graph s0 -> s1 -> ... of the given stages."""
    specs = [
        StageSpec(f"s{i}", stage, after=(f"s{i - 1}",) if i else (), capacity=capacity)
        for i, stage in enumerate(stages)
    ]
    return Graph(specs)
