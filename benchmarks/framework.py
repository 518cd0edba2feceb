"""Framework overhead: items/s through five no-op stages, and submit latency.

    .venv/bin/python benchmarks/framework.py [--items 100000]

Prints one table and one JSON line. Three figures:
- ``async``: items/s submitted from a task on the pipeline's loop, through five
  stages that forward each item (the last is a sink), until the pipeline drains;
- ``bridge``: the same through the sync bridge, submitted from this thread;
- ``submit_us``: latency of ``SyncPipeline.submit`` from this (foreign) thread,
  p50 and p99, while the pipeline works.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import anyio

from kvpipe.pipeline import Emit, Graph, Pipeline, Stage, StageSpec, SyncPipeline
from kvpipe.pipeline.metrics import percentile


class Forward(Stage):
    async def process(self, item: Any, emit: Emit) -> None:
        await emit(item)


class Sink(Stage):
    ports = ()

    async def process(self, item: Any, emit: Emit) -> None:
        pass


def five_noop_stages() -> Graph:
    stages: list[Stage] = [Forward() for _ in range(4)] + [Sink()]
    return Graph(
        StageSpec(f"s{i}", stage, after=(f"s{i - 1}",) if i else ()) for i, stage in enumerate(stages)
    )


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    args = parser.parse_args()
    async_rate = anyio.run(_async_rate, args.items)
    bridge_rate, latencies = _bridge_rate_and_latency(args.items)
    record = {
        "workload": "framework",
        "items": args.items,
        "async_items_per_s": round(async_rate),
        "bridge_items_per_s": round(bridge_rate),
        "submit_p50_us": round(percentile(latencies, 0.50), 2),
        "submit_p99_us": round(percentile(latencies, 0.99), 2),
    }
    width = max(map(len, record))
    for name, value in record.items():
        print(f"{name:<{width}}  {value}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
