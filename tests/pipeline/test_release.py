"""A job is released once no item derived from it reads what the submitter lent.

A stage that copied what it needs emits with ``released=True``; the job is
released when its last borrowing item is finished, which can be long before it
completes. Every way a job ends releases it too.
"""

import threading

import anyio

from kvpipe.pipeline import Graph, Outcome, Pipeline, StageSpec, SyncPipeline

from .toy_stages import AddOne, Fn, Gate, ThreadGate, chain


async def _copy(item, emit):
    await emit(item, released=True)


async def _wait_until(predicate):
    with anyio.fail_after(2):
        while not predicate():
            await anyio.sleep(0.001)


async def test_a_job_is_released_when_its_items_pass_a_copying_stage_before_it_completes():
    gate = Gate()
    async with Pipeline(chain(AddOne(), Fn(_copy), gate)) as pipeline:
        job = await pipeline.submit(1)
        await _wait_until(lambda: gate.entered == 1)
        assert job.released and not job.done
        gate.open.set()
    assert job.outcome is Outcome.OK


async def test_without_a_copying_stage_a_job_is_released_when_it_completes():
    gate = Gate()
    async with Pipeline(chain(AddOne(), gate)) as pipeline:
        job = await pipeline.submit(1)
        await _wait_until(lambda: gate.entered == 1)
        assert not job.released
        gate.open.set()
    assert job.released and job.done


async def test_items_derived_from_a_released_item_do_not_borrow_again():
    gate = Gate()
    async with Pipeline(chain(Fn(_copy), AddOne(), AddOne(), gate)) as pipeline:
        job = await pipeline.submit(1)
        await _wait_until(lambda: gate.entered == 1)
        assert job.released
        gate.open.set()


async def test_with_fan_out_the_job_is_released_only_when_every_branch_stopped_borrowing():
    gate = Gate()

    async def fan(item, emit):
        await emit(item, "copied", released=True)
        await emit(item, "lent")

    graph = Graph(
        [
            StageSpec("fan", Fn(fan, ports=("copied", "lent"))),
            StageSpec("copied", Fn(lambda item, emit: None, ports=()), after=("fan.copied",)),
            StageSpec("lent", gate, after=("fan.lent",)),
        ]
    )
    async with Pipeline(graph) as pipeline:
        job = await pipeline.submit(1)
        await _wait_until(lambda: gate.entered == 1)
        await anyio.sleep(0.01)  # the copied branch has long finished
        assert not job.released
        gate.open.set()
    assert job.released


async def test_release_callbacks_run_once_and_at_once_when_already_released():
    seen = []
    async with Pipeline(chain(Fn(_copy), Gate())) as pipeline:
        job = await pipeline.submit(1)
        job.add_release_callback(lambda j: seen.append(("early", j.id)))
        await _wait_until(lambda: job.released)
        job.add_release_callback(lambda j: seen.append(("late", j.id)))
        pipeline.cancel()
    assert seen == [("early", job.id), ("late", job.id)]


async def test_a_cancelled_job_is_released():
    async with Pipeline(chain(Gate())) as pipeline:
        job = await pipeline.submit(1)
        await anyio.sleep(0.01)
        await pipeline.drain(deadline_s=0.01)
    assert job.outcome is Outcome.FAILED and job.released


def test_a_save_dropped_at_the_sync_bridge_entry_is_released_at_once():
    gate = threading.Event()
    with SyncPipeline(chain(ThreadGate(gate)), queue_capacity=1, when_full="drop") as bridge:
        jobs = [bridge.submit(i) for i in range(5)]
        dropped = [job for job in jobs if job.outcome is Outcome.DROPPED]
        assert dropped and all(job.released for job in dropped)
        gate.set()
