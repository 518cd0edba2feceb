"""Fused chains: stages that only compute run inline in their producer's task, with the same results.

A single-item, single-worker stage that opts in (``fuses = True``) and whose every
producer runs in the task of one single-item, single-worker stage is called from
that task's emits instead of through an inbox. What a graph computes, how its jobs
end and what its metrics count must not change; only the queue hop goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from kvpipe.pipeline import BatchEntry, BatchStage, Emit, Graph, Outcome, Pipeline, Stage, StageSpec

from .toy_stages import AddOne, Collect, Gate


class FusedAddOne(Stage):
    fuses = True

    async def process(self, item: int, emit: Emit) -> None:
        await emit(item + 1)


class FusedCollect(Collect):
    fuses = True


class FusedRaisesOnOdd(Stage):
    fuses = True

    async def process(self, item: int, emit: Emit) -> None:
        if item % 2:
            raise ValueError(f"odd {item}")
        await emit(item)


class FusedSplit(Stage):
    """Even items on ``even``, odd ones on ``odd``."""

    fuses = True
    ports = ("even", "odd")

    async def process(self, item: int, emit: Emit) -> None:
        await emit(item, "odd" if item % 2 else "even")


class FusedSpin(Stage):
    """Burns ``seconds`` of loop time per item without yielding, then forwards it."""

    fuses = True

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def process(self, item: Any, emit: Emit) -> None:
        until = anyio.current_time() + self.seconds
        while anyio.current_time() < until:
            pass
        await emit(item)


class Forward(BatchStage):
    async def process_batch(self, batch: Sequence[BatchEntry[Any]]) -> None:
        for entry in batch:
            await entry.emit(entry.item)


def linear(*stages: Stage | BatchStage, workers: int = 1) -> Graph:
    return Graph(
        StageSpec(f"s{i}", stage, after=(f"s{i - 1}",) if i else (), workers=workers if i == 0 else 1)
        for i, stage in enumerate(stages)
    )


def fused(pipeline: Pipeline) -> dict[str, bool]:
    return {name: snapshot.fused for name, snapshot in pipeline.metrics().items()}


async def test_a_chain_of_opted_in_stages_runs_in_the_entrys_task_with_the_same_results() -> None:
    sink = FusedCollect()
    async with Pipeline(linear(AddOne(), FusedAddOne(), FusedAddOne(), sink)) as pipeline:
        jobs = [await pipeline.submit(i) for i in range(100)]
        assert fused(pipeline) == {"s0": False, "s1": True, "s2": True, "s3": True}
    assert sink.items == [i + 3 for i in range(100)]
    assert {job.outcome for job in jobs} == {Outcome.OK}


async def test_a_stage_that_does_not_opt_in_keeps_its_inbox() -> None:
    async with Pipeline(linear(AddOne(), AddOne(), FusedCollect())) as pipeline:
        assert fused(pipeline) == {"s0": False, "s1": False, "s2": True}


async def test_a_stage_after_a_batch_stage_is_not_fused() -> None:
    async with Pipeline(linear(AddOne(), Forward(), FusedCollect())) as pipeline:
        assert fused(pipeline)["s2"] is False


async def test_a_stage_after_a_producer_with_several_workers_is_not_fused() -> None:
    async with Pipeline(linear(AddOne(), FusedCollect(), workers=2)) as pipeline:
        assert fused(pipeline)["s1"] is False


async def test_a_stage_fed_from_two_tasks_is_not_fused_but_one_fed_from_two_fused_ports_is() -> None:
    evens, odds = FusedCollect(), FusedCollect()
    graph = Graph(
        [
            StageSpec("split", FusedSplit()),
            StageSpec("even", FusedAddOne(), after=("split.even",)),
            StageSpec("odd", AddOne(), after=("split.odd",)),  # its own task
            StageSpec("both", evens, after=("even", "odd")),  # fed from two tasks
            StageSpec("solo", odds, after=("even",)),
        ]
    )
    async with Pipeline(graph) as pipeline:
        for i in range(10):
            await pipeline.submit(i)
        assert fused(pipeline) == {"split": False, "even": True, "odd": False, "both": False, "solo": True}
    assert sorted(evens.items) == list(range(1, 11))
    assert odds.items == [1, 3, 5, 7, 9]


async def test_a_fused_stage_that_raises_fails_only_its_item() -> None:
    sink = FusedCollect()
    async with Pipeline(linear(AddOne(), FusedRaisesOnOdd(), sink)) as pipeline:
        jobs = [await pipeline.submit(i) for i in range(6)]
    assert sink.items == [2, 4, 6]
    assert [job.outcome for job in jobs] == [Outcome.FAILED, Outcome.OK] * 3
    assert pipeline.metrics()["s1"].errors == 3


async def test_a_stage_handed_its_next_item_starts_afresh() -> None:
    """The runtime reuses a stage's emit handle: what it recorded of one item must not touch the next."""

    class FusedFailOdd(Stage):
        fuses = True
        ports = ()

        async def process(self, item: int, emit: Emit) -> None:
            if item % 2:
                emit.fail(f"odd {item}")  # a sink that takes an item without complaint succeeds a unit

    async with Pipeline(linear(AddOne(), FusedAddOne(), FusedFailOdd())) as pipeline:
        jobs = [await pipeline.submit(i) for i in range(6)]
    assert [job.outcome for job in jobs] == [Outcome.OK, Outcome.FAILED] * 3
    assert [(job.succeeded_units, job.failed_units) for job in jobs] == [(1, 0), (0, 1)] * 3


async def test_a_fused_stage_counts_its_items_and_has_no_queue() -> None:
    async with Pipeline(linear(AddOne(), FusedAddOne(), FusedCollect())) as pipeline:
        for i in range(20):
            await pipeline.submit(i)
    metrics = pipeline.metrics()
    assert (metrics["s1"].items_in, metrics["s1"].items_out, metrics["s1"].queue_depth) == (20, 20, 0)
    assert metrics["s2"].items_in == 20


async def test_a_producers_processing_time_leaves_out_its_fused_consumers() -> None:
    async with Pipeline(linear(AddOne(), FusedAddOne(), FusedSpin(0.02), FusedCollect())) as pipeline:
        for i in range(3):
            await pipeline.submit(i)
    metrics = pipeline.metrics()
    assert metrics["s2"].p50_ms >= 20
    assert metrics["s1"].p50_ms < metrics["s2"].p50_ms / 2  # s2 ran inside s1's emit: not s1's time


async def test_a_fused_chain_feeds_a_queue_behind_it_and_drains_on_close() -> None:
    gate = Gate()
    async with Pipeline(linear(AddOne(), FusedAddOne(), gate)) as pipeline:
        job = await pipeline.submit(1)
        with anyio.fail_after(2):
            while gate.entered == 0:
                await anyio.sleep(0.001)
        assert not job.done
        gate.open.set()
    assert job.outcome is Outcome.OK
    assert pipeline.metrics()["s2"].queue_depth == 0


async def test_a_job_released_inside_a_fused_chain_is_released_when_the_chain_returns() -> None:
    async def copy(item: int, emit: Emit) -> None:
        await emit(item, released=True)

    class FusedCopy(Stage):
        fuses = True

        async def process(self, item: int, emit: Emit) -> None:
            await copy(item, emit)

    gate = Gate()
    async with Pipeline(linear(AddOne(), FusedCopy(), gate)) as pipeline:
        job = await pipeline.submit(1)
        with anyio.fail_after(2):
            while not job.released:
                await anyio.sleep(0.001)
        assert not job.done  # the gate, behind its own inbox, still holds the item
        gate.open.set()
