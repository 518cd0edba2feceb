"""framework: what the pipeline itself costs, with stages that do nothing.

Three figures over five no-op stages (four forward, the last is a sink):
- async items/s: submitted from a task on the pipeline's loop, until it drains,
  beside its baseline in the same round: the five stages as bare anyio runs them
  (four forwarding tasks and a sink over memory object streams of the stages'
  inbox size), so the figure is also a ratio (``async / anyio``). The no-op stages
  opt in to fusing, as the save graph's computing stages do, so the pipeline runs
  them as one task after the entry's inbox: the ratio is what the framework's
  accounting costs against what its fused chains save;
- bridge items/s: the same through the sync bridge, from this (foreign) thread;
- submit latency: ``SyncPipeline.submit`` from this thread, p50 and p99, while
  the pipeline works. This is what an engine's step pays per save.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvpipe.pipeline import Emit, Graph, Pipeline, Stage, StageSpec, SyncPipeline
from kvpipe.pipeline.metrics import percentile

from .result import BenchOptions, Target, WorkloadResult

ITEMS = 100_000
QUICK_ITEMS = 5_000


class Forward(Stage):
    fuses = True

    async def process(self, item: Any, emit: Emit) -> None:
        await emit(item)


class Sink(Stage):
    fuses = True
    ports = ()

    async def process(self, item: Any, emit: Emit) -> None:
        pass


def five_noop_stages() -> Graph:
    stages: list[Stage] = [Forward() for _ in range(4)] + [Sink()]
    return Graph(
        StageSpec(f"s{i}", stage, after=(f"s{i - 1}",) if i else ()) for i, stage in enumerate(stages)
    )


async def _bare_anyio_rate(items: int) -> float:
    """The same five hops with nothing else: four forwarding tasks and a sink over memory streams."""
    capacity = StageSpec("s", Sink()).capacity  # a stage's inbox bound, as the pipeline's
    streams = [anyio.create_memory_object_stream[Any](capacity) for _ in range(5)]

    async def forward(inbox: MemoryObjectReceiveStream[Any], outbox: MemoryObjectSendStream[Any]) -> None:
        async with inbox, outbox:
            async for item in inbox:
                await outbox.send(item)

    async def sink(inbox: MemoryObjectReceiveStream[Any]) -> None:
        async with inbox:
            async for _ in inbox:
                pass

    started = time.perf_counter()
    async with anyio.create_task_group() as tasks:
        for hop in range(4):
            tasks.start_soon(forward, streams[hop][1], streams[hop + 1][0])
        tasks.start_soon(sink, streams[4][1])
        entry = streams[0][0]
        async with entry:
            for i in range(items):
                await entry.send(i)
    return items / (time.perf_counter() - started)


async def _async_rate(items: int) -> float:
    async with Pipeline(five_noop_stages()) as pipeline:
        started = time.perf_counter()
        for i in range(items):
            await pipeline.submit(i)
        await pipeline.close()
        return items / (time.perf_counter() - started)


def _bridge_rate_and_latency(items: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    bridge = SyncPipeline(five_noop_stages(), queue_capacity=4096).start()
    started = time.perf_counter()
    for i in range(items):
        before = time.perf_counter_ns()
        bridge.submit(i)
        latencies.append((time.perf_counter_ns() - before) / 1e3)
    bridge.stop(deadline_s=None)
    return items / (time.perf_counter() - started), sorted(latencies)


def run(options: BenchOptions) -> WorkloadResult:
    items = QUICK_ITEMS if options.quick else ITEMS
    rows = []
    for _ in range(1 if options.quick else 3):
        anyio_rate = anyio.run(_bare_anyio_rate, items)
        async_rate = anyio.run(_async_rate, items)
        bridge_rate, latencies = _bridge_rate_and_latency(items)
        rows.append(
            {
                "anyio items/s": round(anyio_rate),
                "async items/s": round(async_rate),
                "async / anyio": round(async_rate / anyio_rate, 3),
                "bridge items/s": round(bridge_rate),
                "submit p50 us": round(percentile(latencies, 0.50), 2),
                "submit p99 us": round(percentile(latencies, 0.99), 2),
            }
        )
    middle = statistics.median_low
    return WorkloadResult(
        workload="framework",
        description=f"five no-op stages, {items:,} items; one row per round, targets on the median round",
        columns=list(rows[0]),
        rows=rows,
        targets=[
            Target(name="async items/s", measured=middle(row["async items/s"] for row in rows), goal=100_000),
            # the ratio is what a busy machine leaves comparable: both sides slow down together
            Target(name="async / anyio", measured=middle(row["async / anyio"] for row in rows), goal=8),
            Target(
                name="submit p99 us", measured=middle(row["submit p99 us"] for row in rows), goal=50, op="<="
            ),
        ],
        parameters={"items": items},
    )
