"""The sync bridge: a pipeline on its own loop thread, fed from ordinary threads."""

import threading

import pytest

from kvpipe.pipeline import Outcome, PipelineClosed, SyncPipeline

from .toy_stages import AddOne, Collect, Fn, Slow, ThreadGate, chain


def test_submits_from_several_threads_all_complete_and_are_handed_back_once():
    sink = Collect()
    per_thread = 500
    with SyncPipeline(chain(AddOne(), sink), queue_capacity=64) as bridge:

        def feed(offset: int) -> None:
            for i in range(per_thread):
                bridge.submit(offset + i)

        threads = [threading.Thread(target=feed, args=(t * per_thread,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    jobs = bridge.completed()
    assert len(jobs) == 4 * per_thread
    assert len({job.id for job in jobs}) == len(jobs)
    assert {job.outcome for job in jobs} == {Outcome.OK}
    assert sorted(sink.items) == [i + 1 for i in range(4 * per_thread)]


def test_a_thread_can_wait_for_its_job():
    with SyncPipeline(chain(Slow(0.01), Collect())) as bridge:
        job = bridge.submit(1)
        assert job.wait(timeout=5)
        assert job.outcome is Outcome.OK


def test_drop_policy_never_blocks_and_counts_what_it_refuses():
    released = threading.Event()
    bridge = SyncPipeline(chain(ThreadGate(released), capacity=1), queue_capacity=2, when_full="drop").start()
    try:
        # The gate holds one item, its inbox one, the bridge queue two: the rest is refused.
        jobs = [bridge.submit(i) for i in range(50)]
        dropped = [job for job in jobs if job.outcome is Outcome.DROPPED]
        assert len(dropped) >= 50 - 5
        assert bridge.dropped == len(dropped)
    finally:
        released.set()
        bridge.stop()
    assert all(job.done for job in jobs)
    assert bridge.outcomes()["dropped"] == len(dropped)


def _full_waiting_bridge(gate: threading.Event) -> SyncPipeline:
    """A started bridge under ``wait`` with no room left until ``gate`` is set."""
    bridge = SyncPipeline(chain(ThreadGate(gate), capacity=1), queue_capacity=1, when_full="wait").start()
    for i in range(3):  # the gate, its inbox and the bridge queue each hold one
        bridge.submit(i, timeout_s=1)
    return bridge


def test_wait_policy_blocks_until_room_then_gives_up_after_the_timeout():
    released = threading.Event()
    bridge = _full_waiting_bridge(released)
    try:
        late = bridge.submit(99, timeout_s=0.05)
        assert late.outcome is Outcome.DROPPED
    finally:
        released.set()
        bridge.stop()


def test_a_submit_waiting_for_room_is_let_in_as_soon_as_the_pipeline_takes_an_item():
    released = threading.Event()
    bridge = _full_waiting_bridge(released)
    try:
        threading.Timer(0.05, released.set).start()
        assert bridge.submit(99, timeout_s=5).outcome is not Outcome.DROPPED
    finally:
        released.set()
        bridge.stop()


def test_a_submit_waiting_for_room_gives_up_when_the_bridge_stops():
    never = threading.Event()
    bridge = _full_waiting_bridge(never)
    outcome: list[object] = []
    waiter = threading.Thread(target=lambda: outcome.append(_submit_or_error(bridge, 99)))
    waiter.start()
    bridge.stop(deadline_s=0.1)
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    assert outcome == [PipelineClosed]


def _submit_or_error(bridge, item):
    try:
        return bridge.submit(item, timeout_s=30).outcome
    except PipelineClosed:
        return PipelineClosed


def test_stop_with_a_deadline_cancels_stuck_work_and_ends_every_job():
    never = threading.Event()
    bridge = SyncPipeline(chain(ThreadGate(never)), queue_capacity=16).start()
    jobs = [bridge.submit(i) for i in range(10)]
    assert bridge.stop(deadline_s=0.1) is False
    assert all(job.done for job in jobs)
    assert {job.outcome for job in jobs} == {Outcome.FAILED}
    assert len(bridge.completed()) == 10


@pytest.mark.parametrize("when_full", ["wait", "drop"])
def test_a_cancelled_stop_leaves_nothing_queued_and_later_submits_are_refused(when_full):
    never = threading.Event()
    bridge = SyncPipeline(chain(ThreadGate(never), capacity=1), queue_capacity=5, when_full=when_full).start()
    for i in range(8):
        bridge.submit(i, timeout_s=0.05)  # the gate and its queue fill, then the inbox
    assert bridge.stop(deadline_s=0.1) is False
    assert bridge.queued == 0
    with pytest.raises(PipelineClosed):
        bridge.submit(99)


def test_submit_after_stop_is_refused():
    bridge = SyncPipeline(chain(Collect())).start()
    assert bridge.stop() is True
    with pytest.raises(PipelineClosed):
        bridge.submit(1)


def test_a_stage_that_fails_to_start_fails_start():
    class Broken(Collect):
        async def start(self):
            raise RuntimeError("cannot open the store")

    with pytest.raises(RuntimeError, match="cannot open the store"):
        SyncPipeline(chain(Broken())).start()


def test_metrics_can_be_read_from_another_thread():
    with SyncPipeline(chain(AddOne(), Collect())) as bridge:
        for job in [bridge.submit(i) for i in range(10)]:
            job.wait(5)
        stats = bridge.metrics()
    assert stats["s0"].items_in == 10
    assert stats["s1"].items_in == 10


def test_an_item_enters_only_once_its_ready_call_returned():
    sink, opened = Collect(), threading.Event()
    with SyncPipeline(chain(AddOne(), sink)) as bridge:
        job = bridge.submit(1, ready=lambda: opened.wait(5))
        assert not job.wait(timeout=0.05) and sink.items == []
        opened.set()
        assert job.wait(timeout=5)
    assert job.outcome is Outcome.OK and sink.items == [2]


def test_consecutive_items_with_the_same_ready_call_wait_once():
    calls = []

    def ready() -> None:
        calls.append(1)

    with SyncPipeline(chain(AddOne(), Collect())) as bridge:
        jobs = [bridge.submit(i, ready=ready) for i in range(5)]
    assert {job.outcome for job in jobs} == {Outcome.OK}
    assert calls == [1]


def test_an_item_whose_ready_call_raises_fails_without_entering_the_pipeline():
    sink = Collect()

    def broken() -> None:
        raise RuntimeError("copy failed")

    with SyncPipeline(chain(AddOne(), sink)) as bridge:
        failed = bridge.submit(1, ready=broken)
        fine = bridge.submit(2)
    assert failed.outcome is Outcome.FAILED and "copy failed" in (failed.first_error or "")
    assert fine.outcome is Outcome.OK and sink.items == [3]



def test_metrics_answer_at_once_while_the_loop_is_held():
    held, release = threading.Event(), threading.Event()

    def hold_the_loop(item: int, emit: object) -> None:
        held.set()
        release.wait(10)  # on the loop thread: nothing else runs there meanwhile

    with SyncPipeline(chain(AddOne(), Fn(hold_the_loop, ports=()))) as bridge:
        bridge.submit(1)
        assert held.wait(5)
        try:
            stats = bridge.metrics()
        finally:
            release.set()
    assert stats["s0"].items_out == 1 and stats["s1"].items_in == 1
