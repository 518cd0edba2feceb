"""The runtime: bounded queues, job accounting, error isolation, drain and cancel."""

import threading
from collections import defaultdict
from types import SimpleNamespace

import anyio
import pytest

from kvpipe.pipeline import BatchPolicy, Graph, Outcome, Pipeline, PipelineClosed, Stage, StageSpec, runtime

from .toy_stages import AddOne, Collect, Fn, Gate, RecordBatches, Slow, chain


async def test_items_flow_through_a_chain_and_jobs_end_ok():
    sink = Collect()
    async with Pipeline(chain(AddOne(), AddOne(), sink)) as pipeline:
        jobs = [await pipeline.submit(i) for i in range(100)]
    assert sorted(sink.items) == [i + 2 for i in range(100)]
    assert {job.outcome for job in jobs} == {Outcome.OK}


async def test_the_queue_bound_holds_under_a_slow_consumer():
    capacity = 4
    fan = Fn(lambda item, emit: _emit_many(emit, 20))
    slow = Slow(0.002)
    graph = Graph(
        [
            StageSpec("fan", fan, capacity=capacity),
            StageSpec("slow", slow, after=("fan",), capacity=capacity),
            StageSpec("sink", Collect(), after=("slow",), capacity=capacity),
        ]
    )
    deepest = 0
    async with Pipeline(graph) as pipeline:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal deepest
                while True:
                    deepest = max(deepest, max(s.queue_depth for s in pipeline.metrics().values()))
                    await anyio.sleep(0.001)

            tg.start_soon(watch)
            for i in range(5):
                await pipeline.submit(i)
            await pipeline.close()
            tg.cancel_scope.cancel()
    assert 0 < deepest <= capacity
    assert pipeline.metrics()["sink"].items_in == 100


async def _emit_many(emit, n):
    for i in range(n):
        await emit(i)


async def test_submit_waits_while_the_entry_is_full():
    gate = Gate()
    async with Pipeline(chain(gate, capacity=2)) as pipeline:
        for i in range(3):  # one in the gate, two queued
            await pipeline.submit(i)
        with anyio.move_on_after(0.2) as waited:
            await pipeline.submit(3)
        assert waited.cancelled_caught
        gate.open.set()


async def test_a_job_completes_only_when_all_derived_work_is_done_across_fan_out_batches_drops_and_errors():
    """Each item fans out to two ports; one port feeds two stages; all meet in a batch stage.

    Item 1's derived items are dropped on one path, item 2 raises on one path; the
    sink records every derived item it sees per job. When a job completes, every
    derived item that could reach the sink must already have reached it.
    """
    reached: defaultdict[int, int] = defaultdict(int)
    seen_at_completion: dict[int, int] = {}

    async def split(item, emit):
        await emit(item, "left")
        await emit(item, "right")

    def maybe_drop(item, emit):
        if item == 1:
            emit.drop("one is dropped on the left path")
            return None
        return emit(item)

    async def maybe_raise(item, emit):
        await anyio.sleep(0.001 * (item % 3))
        if item == 2:
            raise RuntimeError("two fails on the right path")
        await emit(item)

    class CountingSink(Stage):
        ports = ()

        async def process(self, item, emit):
            await anyio.sleep(0.002)
            reached[item] += 1

    graph = Graph(
        [
            StageSpec("split", Fn(split, ports=("left", "right"))),
            StageSpec("left", Fn(maybe_drop), after=("split.left",)),
            StageSpec("right_a", Fn(maybe_raise), after=("split.right",)),
            StageSpec("right_b", Fn(maybe_raise), after=("split.right",)),
            StageSpec(
                "batch", RecordBatches(), after=("left", "right_a", "right_b"), batch=BatchPolicy(4, 0.005)
            ),
            StageSpec("sink", CountingSink(), after=("batch",), workers=3),
        ]
    )

    def on_done(job):
        seen_at_completion[job.item] = reached[job.item]

    async with Pipeline(graph, on_job_done=on_done) as pipeline:
        jobs = {i: await pipeline.submit(i) for i in range(12)}

    expected = {i: 3 for i in range(12)} | {1: 2, 2: 1}
    assert seen_at_completion == expected
    assert {i: j.outcome for i, j in jobs.items()} == {i: Outcome.OK for i in range(12)} | {
        2: Outcome.PARTIAL
    }
    assert jobs[1].counts["dropped"] == 1
    assert jobs[2].failed_units == 2 and "two fails" in jobs[2].first_error


async def test_a_failing_item_does_not_stop_the_pipeline():
    def explode_on_three(item, emit):
        if item == 3:
            raise ValueError("bad item")
        return emit(item)

    sink = Collect()
    async with Pipeline(chain(Fn(explode_on_three), sink)) as pipeline:
        jobs = [await pipeline.submit(i) for i in range(6)]
    assert sorted(sink.items) == [0, 1, 2, 4, 5]
    assert jobs[3].outcome is Outcome.FAILED
    assert jobs[3].first_error == "ValueError: bad item"
    assert pipeline.metrics()["s0"].errors == 1


async def test_emitting_on_an_unknown_port_fails_that_item():
    async with Pipeline(chain(Fn(lambda item, emit: emit(item, "nope")), Collect())) as pipeline:
        job = await pipeline.submit(1)
    assert job.outcome is Outcome.FAILED
    assert "no output port 'nope'" in job.first_error


async def test_a_stage_reported_failure_makes_the_job_partial_when_other_units_succeed():
    def half(item, emit):
        emit.fail("one object refused")
        emit.succeed(2)

    async with Pipeline(chain(Fn(half, ports=()))) as pipeline:
        job = await pipeline.submit(1)
    assert job.outcome is Outcome.PARTIAL
    assert (job.failed_units, job.succeeded_units) == (1, 2)


async def test_closing_drains_everything_queued():
    sink = Collect()
    async with Pipeline(chain(Slow(0.001), Slow(0.001), sink)) as pipeline:
        for i in range(50):
            await pipeline.submit(i)
        await pipeline.close()
        assert len(sink.items) == 50
        assert len(pipeline.jobs) == 0


async def test_submit_after_close_is_refused():
    async with Pipeline(chain(Collect())) as pipeline:
        await pipeline.close()
        with pytest.raises(PipelineClosed):
            await pipeline.submit(1)


async def test_cancel_stops_promptly_and_ends_open_jobs_as_failed():
    gate = Gate()
    with anyio.fail_after(2):
        async with Pipeline(chain(gate)) as pipeline:
            jobs = [await pipeline.submit(i) for i in range(3)]
            await anyio.sleep(0.01)
            drained = await pipeline.drain(deadline_s=0.05)
    assert not drained
    assert all(job.outcome is Outcome.FAILED and job.first_error == "cancelled" for job in jobs)


async def test_a_batch_stage_gets_at_most_max_items():
    batches = RecordBatches()
    graph = Graph(
        [StageSpec("b", batches, batch=BatchPolicy(max_items=8)), StageSpec("sink", Collect(), after=("b",))]
    )
    async with Pipeline(graph) as pipeline:
        for i in range(50):
            await pipeline.submit(i)
    assert sum(batches.sizes) == 50
    assert max(batches.sizes) == 8


async def test_a_batch_is_flushed_after_max_wait_when_not_full():
    batches = RecordBatches()
    graph = Graph(
        [StageSpec("b", batches, batch=BatchPolicy(100, 0.05)), StageSpec("sink", Collect(), after=("b",))]
    )
    async with Pipeline(graph) as pipeline:
        job = await pipeline.submit(1)
        with anyio.fail_after(1):
            await job.finished()
    assert batches.sizes == [1]


async def test_a_raising_batch_fails_every_item_of_the_batch():
    class Explodes(RecordBatches):
        async def process_batch(self, batch):
            raise RuntimeError("store down")

    graph = Graph(
        [StageSpec("b", Explodes(), batch=BatchPolicy(4, 0.01)), StageSpec("sink", Collect(), after=("b",))]
    )
    async with Pipeline(graph) as pipeline:
        jobs = [await pipeline.submit(i) for i in range(4)]
    assert [j.outcome for j in jobs] == [Outcome.FAILED] * 4
    assert pipeline.metrics()["b"].errors == 4


async def test_blocking_calls_run_in_threads_under_the_stage_limit():
    running = 0
    most = 0
    lock = threading.Lock()

    def blocking():
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        threading.Event().wait(0.02)
        with lock:
            running -= 1

    class Blocking(Stage):
        ports = ()
        thread_limit = 2

        async def process(self, item, emit):
            await self.run_blocking(blocking)

    graph = Graph([StageSpec("b", Blocking(), workers=6)])
    async with Pipeline(graph) as pipeline:
        for i in range(12):
            await pipeline.submit(i)
    assert most == 2


async def test_metrics_count_in_out_drops_and_errors_with_processing_times():
    def route(item, emit):
        if item % 3 == 0:
            emit.drop("multiple of three")
        elif item % 3 == 1:
            raise RuntimeError("boom")
        else:
            return emit(item)

    async with Pipeline(chain(Fn(route), Collect())) as pipeline:
        for i in range(9):
            await pipeline.submit(i)
    stats = pipeline.metrics()["s0"]
    assert (stats.items_in, stats.items_out, stats.dropped, stats.errors) == (9, 3, 3, 3)
    assert stats.p99_ms >= stats.p50_ms > 0
    assert stats.as_dict().keys() >= {"in", "out", "dropped", "errors", "p50_ms", "p99_ms", "queue_depth"}


async def test_a_stage_times_its_first_item_and_one_in_eight_after_it(monkeypatch):
    clock = [0.0]  # seconds; an item i takes i of them
    monkeypatch.setattr(runtime, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def take_item_seconds(item, emit):
        clock[0] += item

    async with Pipeline(chain(Fn(take_item_seconds, ports=()))) as pipeline:
        for i in range(9):
            await pipeline.submit(i)
    stats = pipeline.metrics()["s0"]
    # timed: items 0 and 8 (all nine would put the median at 4 s)
    assert (stats.items_in, stats.p50_ms, stats.p99_ms) == (9, 0.0, 8000.0)


async def test_stage_start_and_stop_are_called_once():
    calls = []

    class Lifecycle(Collect):
        async def start(self):
            calls.append("start")

        async def stop(self):
            calls.append("stop")

    async with Pipeline(chain(Lifecycle())) as pipeline:
        await pipeline.submit(1)
    assert calls == ["start", "stop"]


class _PassThrough(Stage):
    """Forwards unchanged, and says so: the runtime should never call it."""

    passes_through = True

    def __init__(self) -> None:
        self.calls = 0

    async def process(self, item, emit):
        self.calls += 1
        await emit(item)


async def test_a_stage_that_passes_through_is_wired_around_and_never_called():
    first, second, sink = _PassThrough(), _PassThrough(), Collect()
    async with Pipeline(chain(AddOne(), first, second, sink)) as pipeline:
        jobs = [await pipeline.submit(i) for i in range(10)]
    assert sorted(sink.items) == [i + 1 for i in range(10)]
    assert (first.calls, second.calls) == (0, 0)
    assert {job.outcome for job in jobs} == {Outcome.OK}


async def test_an_entry_stage_that_passes_through_still_runs():
    entry, sink = _PassThrough(), Collect()
    async with Pipeline(chain(entry, sink)) as pipeline:
        await pipeline.submit(1)
    assert (entry.calls, sink.items) == (1, [1])


async def test_metrics_mark_the_stages_wired_around():
    async with Pipeline(chain(AddOne(), _PassThrough(), Collect())) as pipeline:
        await pipeline.submit(1)

    assert {name: s.passes_through for name, s in pipeline.metrics().items()} == {
        "s0": False,
        "s1": True,
        "s2": False,
    }
