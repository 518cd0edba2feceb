"""A job may carry a deadline; stages see, through ``emit.expired``, that it has passed."""

import time

import pytest

from kvpipe.pipeline import Job, Outcome, Pipeline, SyncPipeline

from .toy_stages import Collect, Fn, Slow, chain


def test_a_job_without_a_deadline_never_expires():
    job = Job("item")

    assert job.deadline == float("inf") and not job.expired


def test_a_job_expires_once_its_deadline_has_passed():
    job = Job("item", deadline_s=0.01)
    assert not job.expired

    time.sleep(0.02)

    assert job.expired and job.deadline == pytest.approx(job.submitted_at + 0.01)


def _expiry_seen(seen: list[bool]) -> Fn:
    def look(item, emit):
        seen.append(emit.expired)

    return Fn(look, ports=())


async def test_stages_see_that_the_job_of_their_item_expired_on_its_way():
    seen: list[bool] = []
    async with Pipeline(chain(Slow(0.05), _expiry_seen(seen)), job_deadline_s=0.02) as pipeline:
        job = await pipeline.submit("late")
    await job.finished()

    assert seen == [True] and job.outcome is Outcome.OK  # what to do about it is the stage's call


async def test_jobs_within_their_deadline_are_not_expired():
    seen: list[bool] = []
    async with Pipeline(chain(_expiry_seen(seen)), job_deadline_s=10) as pipeline:
        await pipeline.submit("on time")

    assert seen == [False]


def test_the_sync_bridge_gives_every_job_its_deadline():
    with SyncPipeline(chain(Collect()), job_deadline_s=5) as bridge:
        job = bridge.submit("x")

    assert job.deadline == pytest.approx(job.submitted_at + 5)


@pytest.mark.parametrize("deadline", [0, -1])
def test_a_deadline_that_is_not_positive_is_refused_naming_the_field(deadline):
    with pytest.raises(ValueError, match=f"job_deadline_s: must be > 0, got {deadline}"):
        Pipeline(chain(Collect()), job_deadline_s=deadline)
    with pytest.raises(ValueError, match=f"job_deadline_s: must be > 0, got {deadline}"):
        SyncPipeline(chain(Collect()), job_deadline_s=deadline)
