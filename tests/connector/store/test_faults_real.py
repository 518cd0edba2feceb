"""Faults of the real store under a running save pipeline: a stalled master, a killed one, a dead peer.

Each test spawns its own ``mooncake_master`` (:class:`LocalMaster`), opens a real
client with a short RPC deadline behind a circuit breaker, and runs the default
save graph on a :class:`SyncPipeline` (``when_full="drop"``, a small queue) while a
feeder thread submits a request every couple of milliseconds, as an engine's
step loop would. In the middle of the run the fault strikes; then the test checks
what an engine needs from the connector whatever the store does:

- ``submit`` never waits: a full entry refuses the item (no submit ever waits for
  room), and the entry queue stays bounded;
- every job ends, ok or failed, and has released the engine's blocks when it does;
  every object of it ends as one of put, existing, failed or throttled;
- no store call is made for a job without asking whether it is past its deadline
  (since its previous call), and none once the answer was yes: the stages' deadline
  checks and the store calls are numbered in one sequence, so which came first is a
  fact, not a timing; while the master is gone the breaker opens and fails calls fast;
- after the master's (or the segment's) return, new saves are stored again (how soon is
  printed; the issue's 3 s is wall time, which 2 busy cores stretch, so a guard against a
  hang is all that bounds it), and while a killed master is down the store answers calls
  itself instead of the client spending seconds reconnecting on each;
- stopping the pipeline and closing the store leaves no thread behind and the
  memory where it was.

Wall times (submit latencies, job durations, how late calls started) are printed
(``-s``) and bound only by backstops far above what any healthy run shows: a job
that outlives its deadline plus two of the longest calls plus a second, or a submit
that sleeps for a third of an RPC deadline, is a broken deadline or a store call
holding the interpreter lock, never the OS running a thread late on 2 busy cores.

The 60 s stall of the issue is shortened: with ``rpc_timeout_ms`` at 300 ms a
stall of 3 s is ten RPC deadlines, which is what the bounds depend on (the
breaker stops the calls after ``failures_to_open`` of them; a longer stall only
repeats the open/probe cycle).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import structlog

from kvpipe.connector.bench.peer import remote_segment
from kvpipe.connector.bench.schedstat import ScheduledTime
from kvpipe.connector.store.breaker import BreakerSettings, CircuitBreaker, GuardedStore
from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore, harness
from kvpipe.connector.store.mooncake.master import LocalMaster, MasterEndpoints
from kvpipe.connector.store.protocol import ForwardingStore, Store
from kvpipe.pipeline import SyncPipeline
from kvpipe.pipeline.jobs import Job, Outcome
from kvpipe.stages import default_save_graph
from kvpipe.stages.integrity import is_seal_key, sealed_key
from kvpipe.stages.model import StoreObject
from kvpipe.stages.object_status import DEADLINE_PASSED, ObjectStatus
from kvpipe.stages.store import Code

from ...stages.kv_fixtures import KVFixture, make_kv, make_request

pytestmark = pytest.mark.mooncake

RPC_TIMEOUT_MS = 300
BREAKER = BreakerSettings(failures_to_open=2, open_s=0.3)
QUEUE_CAPACITY = 32
SUBMIT_EVERY_S = 0.002
TOKENS = 32  # two 16-token blocks: two objects per request
# A guard against a hang, not a speed requirement (the issue asks for 3 s, in wall time). What
# the code sets: after the store's return, a call in flight ends within its RPC deadline (0.3 s;
# to a dead peer, its transfer's ~1 s: TRANSFER_FAIL_S), the breaker lets a probe through
# open_s (0.3 s) after that last failure, and a job submitted once the probe closed it ends
# within its deadline (JOB_DEADLINE_S, 0.5 s): under 2.5 s in all. The guard is ten times that,
# for the master's and the client's own reconnection on starved cores.
RECOVERY_GUARD_S = 25.0
# Every job has this deadline. A call in flight is never cut short (it may be reading the
# engine's blocks): the stages ask whether a job is past its deadline before each store call
# for it and make none once it is, which check_jobs checks exactly, in the order of events.
# How long after its deadline a job then ends is wall time, bound only by a backstop: its
# deadline, two of the longest calls, and a second of slack for scheduling (7-10 times the
# worst seen on 2 busy cores). Two calls, not one, because of what these runs showed: a job
# failed for its deadline at the start of a batch still ends with its batch, after the call
# made for the others in it (~1 s to a dead peer); and the put stage's back-off (up to 0.2 s
# while the store answers -200) comes after the check, so a put may start that much past
# the deadline of a job it carries. Both are printed. The backstop still fails a job that
# waits out the 3 s stall, or calls that no deadline bounds.
JOB_DEADLINE_S = 0.5
BACKSTOP_SLACK_S = 1.0
# A submit appends to a deque under a lock no store call is made under, and never waits for
# the loop or the store; under "drop" a full entry refuses at once. That is checked exactly
# (no submit waited for room). The time a submit slept (wall time minus time on a CPU or in
# the run queue) is also bound, as a backstop for the one wait no count sees: a store call
# that holds the interpreter lock, during which every submit sleeps until the call returns
# (300 ms at least, under these faults). The interpreter lock held by the pipeline's own
# threads costs a submit up to a switch interval (5 ms) each: measured up to 8.2 ms on a
# busy 2-core machine. A third of the RPC deadline sits far above the one, below the other.
SUBMIT_BLOCKED_BACKSTOP_S = RPC_TIMEOUT_MS / 1000 / 3
# A put to a dead peer's segment fails (-800) after ~1 s, the transfer engine's own
# timeout (not a master RPC: neither MC_RPC_TIMEOUT_MS nor the breaker bound it; the
# put stage's slow-store throttle may shed the puts after it). Measured 1.0-1.25 s on
# busy cores; the longest such call the backstop allows for is 1.5 s.
TRANSFER_FAIL_S = 1.5
RSS_GROWTH_BYTES = 64 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


class CountingCondition(threading.Condition):
    """The bridge's "room in the entry" condition, counting the waits on it (a submit waiting for room)."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def _count_waits_for_room(pipeline: SyncPipeline) -> CountingCondition:
    """Swap the bridge's room condition for a counting one (before it starts); returns it."""
    assert isinstance(pipeline._room, threading.Condition), "the bridge's room condition moved: update this"
    counting = CountingCondition(pipeline._lock)
    pipeline._room = counting
    return counting


@dataclass(frozen=True)
class Call:
    """One store call a stage made: its keys, its place in the run's sequence, and its wall times."""

    operation: str
    keys: tuple[str, ...]
    order: int  # taken as it started, in one sequence with the deadline checks
    started: float
    ended: float
    codes: frozenset[int]  # the distinct answers (empty if it raised)


class LoggedStore(ForwardingStore):
    """The store as the stages see it (in front of the breaker): logs every exist and put call."""

    def __init__(self, inner: Store, order: Iterator[int]) -> None:
        super().__init__(inner)
        self._order = order
        self.calls: list[Call] = []

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return self._logged("exist", keys, lambda: self.inner.batch_is_exist(keys))

    def batch_put_from_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], config: Any
    ) -> list[int]:
        put = self.inner.batch_put_from_multi_buffers
        return self._logged("put", keys, lambda: put(keys, ptrs, sizes, config))

    def _logged(self, operation: str, keys: Sequence[str], call: Callable[[], list[int]]) -> list[int]:
        order, started = next(self._order), time.monotonic()  # next() on a count is atomic under the GIL
        codes: list[int] = []
        try:
            codes = call()
            return codes
        finally:
            self.calls.append(
                Call(operation, tuple(keys), order, started, time.monotonic(), frozenset(map(int, codes)))
            )


@dataclass
class DeadlineChecks:
    """Every answer :attr:`Job.expired` gave the stages, numbered in one sequence with the store calls.

    ``within``: per job id, the order of each check that found it within its deadline;
    ``past``: per job id, the order of the first that found it past.
    """

    order: Iterator[int]
    within: dict[int, list[int]] = field(default_factory=dict)
    past: dict[int, int] = field(default_factory=dict)

    def record(self, job: Job, gone: bool) -> None:
        order = next(self.order)  # after the answer: any call it allowed starts later
        if gone:
            self.past.setdefault(job.id, order)
        else:
            self.within.setdefault(job.id, []).append(order)


@contextmanager
def watching_deadlines(order: Iterator[int]) -> Iterator[DeadlineChecks]:
    """Record what :attr:`Job.expired` answers (unchanged) while the block runs."""
    checks = DeadlineChecks(order)
    original = vars(Job)["expired"]
    assert isinstance(original, property) and original.fget is not None
    answer = original.fget

    def expired(job: Job) -> bool:
        gone: bool = answer(job)
        checks.record(job, gone)
        return gone

    with mock.patch.object(Job, "expired", property(expired)):
        yield checks


@dataclass
class Feeder:
    """A thread that submits fresh requests at a steady pace and times every submit."""

    pipeline: SyncPipeline
    fixture: KVFixture
    jobs: list[Job] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    blocked: list[float] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    max_queued: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="feeder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(10)
        assert not self._thread.is_alive()

    def _run(self) -> None:
        i = 0
        clock = time.monotonic
        scheduled = ScheduledTime()
        while not self._stop.is_set():
            request = make_request(self.fixture.kv, TOKENS, request_id=f"r{i}")  # fresh hashes
            before = scheduled.seconds()
            started = clock()
            job = self.pipeline.submit(request)
            latency = clock() - started
            self.latencies.append(latency)
            self.blocked.append(max(0.0, latency - (scheduled.seconds() - before)))
            self.starts.append(started)
            self.jobs.append(job)
            self.max_queued = max(self.max_queued, self.pipeline.queued)
            i += 1
            time.sleep(SUBMIT_EVERY_S)

    def submitted_after(self, t: float) -> list[Job]:
        return [job for job in list(self.jobs) if job.submitted_at >= t]


@dataclass
class Run:
    master: LocalMaster
    store: GuardedStore
    logged: LoggedStore
    checks: DeadlineChecks
    room: CountingCondition
    owners: dict[str, str]  # object key -> the request id it came from (each object's final status)
    fixture: KVFixture
    pipeline: SyncPipeline
    feeder: Feeder
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic()

    def wait_for_saves(self, since: float, timeout_s: float) -> float:
        """Seconds from ``since`` until a job submitted after it has stored its objects."""
        deadline = since + timeout_s + 2.0  # look a little past the bound, to report the miss
        while time.monotonic() < deadline:
            stored = [
                job.finished_at
                for job in self.feeder.submitted_after(since)
                if job.done and job.counts["put"] > 0 and job.finished_at is not None
            ]
            if stored:
                return min(stored) - since
            time.sleep(0.02)
        return float("inf")

    def healthy(self, timeout_s: float = 5.0) -> None:
        """Wait until saves are stored (the run starts healthy)."""
        assert self.wait_for_saves(time.monotonic(), timeout_s) < timeout_s

    def calls_by_job(self) -> dict[Job, list[Call]]:
        """Per job, the store calls that carried its objects (or their seals)."""
        by_request = {job.item.request_id: job for job in self.feeder.jobs}
        calls: dict[Job, list[Call]] = {}
        for call in self.logged.calls:
            owners = {self.owners.get(sealed_key(key) if is_seal_key(key) else key) for key in call.keys}
            assert None not in owners, f"a {call.operation} call carried an object with no final status"
            for request_id in owners:
                calls.setdefault(by_request[request_id], []).append(call)
        return calls


def _settings(endpoints: MasterEndpoints, **overrides: object) -> MooncakeSettings:
    return MooncakeSettings.model_validate(
        {
            "master": endpoints.master_address,
            "metadata_server": endpoints.metadata_server,
            "global_segment_size": "64MB",
            "local_buffer_size": 0,
            "rpc_timeout_ms": RPC_TIMEOUT_MS,
            **overrides,
        }
    )


def _rpc_timeout_s() -> float:
    """The deadline the client really has (an MC_RPC_TIMEOUT_MS set by the user wins)."""
    return int(os.environ.get("MC_RPC_TIMEOUT_MS", RPC_TIMEOUT_MS)) / 1000


@contextmanager
def running_pipeline(master: LocalMaster, **settings: object) -> Iterator[Run]:
    """A save pipeline on a real client of ``master``, fed steadily; checks leaks on exit."""
    assert master.endpoints is not None
    threads_before, native_before, rss_before = threading.active_count(), _native_threads(), _rss_bytes()
    fixture = make_kv(num_blocks=8)
    inner = MooncakeStore.open(_settings(master.endpoints, **settings))
    store = GuardedStore(inner, CircuitBreaker(BREAKER))
    order = itertools.count()
    logged = LoggedStore(store, order)
    owners: dict[str, str] = {}

    def observe(record: StoreObject, status: ObjectStatus) -> None:
        owners[record.key] = record.request_id

    tensors = [t for layers in fixture.tensors.values() for t in layers]
    for t in tensors:
        assert store.register_buffer(t.data_ptr(), t.numel() * t.element_size()) == 0

    with watching_deadlines(order) as checks:
        pipeline = SyncPipeline(
            default_save_graph(fixture.kv, logged, observer=observe),
            queue_capacity=QUEUE_CAPACITY,
            when_full="drop",
            name="faults",
            job_deadline_s=JOB_DEADLINE_S,
        )
        room = _count_waits_for_room(pipeline)
        pipeline.start()
        feeder = Feeder(pipeline, fixture)
        feeder.start()
        run = Run(master, store, logged, checks, room, owners, fixture, pipeline, feeder)
        try:
            run.healthy()
            yield run
        finally:
            feeder.stop()
            run.mark("stopping")
            drained = pipeline.stop(deadline_s=15)
            for t in tensors:
                store.unregister_buffer(t.data_ptr())
            store.close()
    assert drained
    _report(run, threads_before, native_before, rss_before)


def _report(run: Run, threads_before: int, native_before: int, rss_before: int) -> None:
    deadline = time.monotonic() + 5
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    threads_after, native_after, rss_after = threading.active_count(), _native_threads(), _rss_bytes()
    jobs = run.feeder.jobs
    latencies = sorted(run.feeder.latencies)
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    p999 = latencies[int(0.999 * (len(latencies) - 1))]
    processed = [job for job in jobs if job.outcome is not Outcome.DROPPED]
    durations = sorted(job.elapsed_s or 0.0 for job in processed)
    outcomes: dict[str, int] = {}
    for job in jobs:
        outcomes[str(job.outcome)] = outcomes.get(str(job.outcome), 0) + 1
    t0 = run.marks.get("fault", 0.0)
    triples = zip(run.feeder.latencies, run.feeder.blocked, run.feeder.starts, strict=True)
    slowest = [
        (round(start - t0, 3), round(lat * 1e6), round(blocked * 1e6))
        for lat, blocked, start in sorted(triples, reverse=True)[:6]
    ]
    print(
        f"\n  jobs={len(jobs)} outcomes={outcomes} breaker_opened={run.store.breaker.opened}"
        f" refused={run.store.breaker.refused} throttled={sum(job.counts['throttled'] for job in jobs)}"
        f"\n  submit: p50={latencies[len(latencies) // 2] * 1e6:.0f}us p99={p99 * 1e6:.0f}us"
        f" p99.9={p999 * 1e6:.0f}us max={latencies[-1] * 1e6:.0f}us max_queued={run.feeder.max_queued}"
        f" waits for room={run.room.waits}"
        f"\n  job s: p50={durations[len(durations) // 2]:.3f}"
        f" p99={durations[int(0.99 * (len(durations) - 1))]:.3f} max={durations[-1]:.3f}"
        f"\n  marks (s after the fault): { {k: round(v - t0, 3) for k, v in run.marks.items()} }"
        f" blocked max={max(run.feeder.blocked) * 1e6:.0f}us"
        f"\n  slowest submits (s after the fault, wall us, blocked us): {slowest}"
        f"\n  python threads {threads_before}->{threads_after},"
        f" native threads {native_before}->{native_after}, rss {rss_before >> 20}->{rss_after >> 20} MiB"
    )
    _report_deadlines(run, run.calls_by_job())
    assert threads_after <= threads_before, "a Python thread outlived the pipeline and the store"
    assert native_after <= native_before + 2, "native threads outlived the store"
    assert rss_after - rss_before < RSS_GROWTH_BYTES


def _report_deadlines(run: Run, calls_by_job: dict[Job, list[Call]]) -> None:
    """How the deadlines went in wall time: printed, never asserted."""
    checks = run.checks
    jobs = [job for job in run.feeder.jobs if job.outcome is not Outcome.DROPPED]
    late = [call.started - job.deadline for job, calls in calls_by_job.items() for call in calls]
    late = [s for s in late if s > 0]
    overrun = sorted(jobs, key=lambda job: (job.finished_at or 0) - job.deadline)
    latest = [
        (
            job.id,
            round((job.finished_at or 0) - job.deadline, 3),
            dict(job.counts),
            job.first_error,
            [(c.operation, round(c.started - job.deadline, 3), round(c.ended - c.started, 3)) for c in calls],
        )
        for job in overrun[-3:]
        for calls in [calls_by_job.get(job, [])]
    ]
    failed_for_it = sum(1 for job in jobs if DEADLINE_PASSED in (job.first_error or ""))
    after_fault = [call for call in run.logged.calls if call.started >= run.marks.get("fault", math.inf)]
    kinds: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    for call in after_fault:
        kinds.setdefault((call.operation, tuple(sorted(call.codes))), []).append(call.ended - call.started)
    summary = {kind: (len(spent), round(max(spent), 3)) for kind, spent in sorted(kinds.items())}
    print(
        f"\n  deadline checks: {sum(map(len, checks.within.values()))} within,"
        f" {len(checks.past)} jobs found past, {failed_for_it} jobs failed for it;"
        f" store calls: {len(run.logged.calls)},"
        f" {len(late)} (job, call) pairs started past the job's deadline"
        f" (the latest {max(late, default=0.0) * 1e3:.1f} ms past it)"
        f"\n  calls from the fault on, per (op, answers): (how many, longest s): {summary}"
        f"\n  latest ends (job, s past its deadline, counts, first error, its calls (op, s past, s)):"
        + "".join(f"\n    {row}" for row in latest)
    )


def check_jobs(run: Run, longest_call_s: float) -> None:
    """What the code controls, exactly; then wall-time backstops.

    Every job ended and released the engine's blocks, each of its objects with one
    status; the entry never overfilled and no submit waited for room; a stage asked
    whether a job was past its deadline before each store call for it (since its
    previous one), and made none once told it was.
    """
    jobs = run.feeder.jobs
    assert jobs and all(job.done for job in jobs)
    assert all(job.released for job in jobs)
    assert run.pipeline.dropped == sum(1 for job in jobs if job.outcome is Outcome.DROPPED)
    for job in jobs:
        if job.outcome is not Outcome.DROPPED:
            counts = job.counts
            ended = counts["put"] + counts["existing"] + counts["failed"] + counts["throttled"]
            assert counts["considered"] == ended == 2, f"job {job.id}: objects without an end: {dict(counts)}"
    assert run.feeder.max_queued <= QUEUE_CAPACITY
    assert run.room.waits == 0, f"{run.room.waits} submits waited for room under when_full='drop'"
    # The deadline as the stages keep it, in the order of events (no clock involved).
    calls_by_job = run.calls_by_job()
    unasked, after_past = [], []
    for job, calls in calls_by_job.items():
        asked = run.checks.within.get(job.id, [])
        past = run.checks.past.get(job.id)
        previous = -1
        for call in sorted(calls, key=lambda call: call.order):
            if not any(previous < order < call.order for order in asked):
                unasked.append((job.id, call.operation))
            if past is not None and past < call.order:
                after_past.append((job.id, call.operation, round(call.started - job.deadline, 3)))
            previous = call.order
    assert not unasked, (
        f"{len(unasked)} store calls made for a job not checked against its deadline since its previous"
        f" call (job, call): {unasked[:5]}"
    )
    assert not after_past, (
        f"{len(after_past)} store calls started for jobs already found past their deadline"
        f" (job, call, s past the deadline): {after_past[:5]}"
    )
    # Backstops, in wall time (see the constants).
    backstop_s = JOB_DEADLINE_S + 2 * longest_call_s + BACKSTOP_SLACK_S
    slow = [(job.id, round(job.elapsed_s or 0, 3)) for job in jobs if (job.elapsed_s or 0) > backstop_s]
    assert not slow, f"{len(slow)} jobs outlived {backstop_s:.2f} s: {slow[:5]}"
    assert max(run.feeder.blocked) < SUBMIT_BLOCKED_BACKSTOP_S


def recovery(run: Run, since: float) -> float:
    """Seconds from the store's return until a save submitted after it stored its objects (printed)."""
    took = run.wait_for_saves(since, RECOVERY_GUARD_S)
    run.mark("stored again")
    assert took <= RECOVERY_GUARD_S, (
        f"no save submitted after the store's return was stored (waited {RECOVERY_GUARD_S} s)"
    )
    return took


@pytest.fixture(scope="module", autouse=True)
def _native_singletons() -> None:
    """Open and close one client first: the library keeps a few process-wide threads from then on."""
    with LocalMaster() as first:
        assert first.endpoints is not None
        with MooncakeStore.open(_settings(first.endpoints)) as store:
            assert store.batch_is_exist(["warm-up"]) == [0]


@pytest.fixture(autouse=True)
def _quiet_logs() -> None:
    """Per-item debug lines (one per failed object) would print thousands of lines a second."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


@pytest.fixture
def master() -> Iterator[LocalMaster]:
    with LocalMaster(client_ttl_s=2) as running:
        yield running


# -- the faults ------------------------------------------------------------------------------


def test_a_master_stopped_for_ten_rpc_deadlines_stalls_no_submit_and_no_job(master: LocalMaster) -> None:
    with running_pipeline(master) as run:
        time.sleep(0.5)
        run.mark("fault")
        harness.pause(master)
        time.sleep(10 * _rpc_timeout_s())
        harness.resume(master)
        run.mark("back")
        recovery(run, run.marks["back"])
        time.sleep(0.5)
    # A call to the stopped master lasts one RPC deadline (it answers -901); after two such
    # calls the breaker fails calls fast.
    assert run.store.breaker.opened >= 1 and run.store.breaker.refused > 0
    check_jobs(run, longest_call_s=_rpc_timeout_s())


def test_a_killed_master_replaced_on_the_same_ports_is_picked_up(master: LocalMaster) -> None:
    assert master.endpoints is not None
    endpoints = master.endpoints
    with running_pipeline(master) as run:
        time.sleep(0.5)
        run.mark("fault")
        master.kill()
        time.sleep(2.0)
        run.mark("restarting")
        master.start(endpoints)
        run.mark("back")
        recovery(run, run.marks["back"])
        time.sleep(0.5)
    # While the master is gone calls fail and the breaker opens. Whether it then refuses a
    # call is timing, not the code's: its half-open probe may be the one call in flight until
    # the new master answers (a call to a killed master can take ~2 s), and jobs past their
    # deadline make no call to refuse. Failing calls fast is the stopped-master test's check.
    assert run.store.breaker.opened >= 1
    check_jobs(run, longest_call_s=1.5)


@contextmanager
def peer_segment(master: LocalMaster, segment_bytes: int = 64 << 20) -> Iterator[Callable[[], None]]:
    """A peer process holding a segment on ``master`` (the bench's peer); yields a kill -9."""
    assert master.endpoints is not None
    e = master.endpoints
    with remote_segment(e.master_address, e.metadata_server, segment_bytes) as peer:
        yield peer.kill


def test_a_peer_holding_the_only_segment_killed_and_replaced(master: LocalMaster) -> None:
    with peer_segment(master) as kill_peer, running_pipeline(master, global_segment_size=0) as run:
        time.sleep(0.5)
        run.mark("fault")
        kill_peer()
        time.sleep(3.0)  # past the master's client_ttl (2 s): the dead peer's segment is dropped
        run.mark("restarting")
        with peer_segment(master):
            run.mark("back")
            recovery(run, run.marks["back"])
            time.sleep(0.5)
    # Puts to the dead peer's segment fail (-800) after the transfer timeout (~1 s);
    # that is the store working, not its master failing, so the breaker never opens.
    puts = [
        call for call in run.logged.calls if call.operation == "put" and call.started >= run.marks["fault"]
    ]
    assert any(Code.TRANSFER_FAILED in call.codes for call in puts)
    assert run.store.breaker.opened == 0
    # The put stage's throttle sheds puts once it has measured them slow, and only then. Whether
    # it measures a dead peer's puts slow before the master drops the segment is the host's
    # doing: it discounts the time the calling thread waited for a CPU, and on busy cores most
    # of such a put's second is spent so (measured: 0.73 s of 1.08 s under two CPU hogs). Its
    # own tests (tests/stages/test_throttle.py) pin the rest down.
    (put,) = [spec.stage for spec in run.pipeline.graph.specs if spec.name == "put"]
    throttled = sum(job.counts["throttled"] for job in run.feeder.jobs)
    print(f"  throttle: slow spells={put.throttle.slow_spells}, objects throttled={throttled}")
    assert (put.throttle.slow_spells > 0) == (throttled > 0)
    check_jobs(run, longest_call_s=TRANSFER_FAIL_S)


def test_while_a_killed_master_is_down_the_store_answers_calls_without_the_client() -> None:
    """The client spends ~4.5 s per call reconnecting to a dead master; the store answers -900 itself,
    and calls the client again as soon as the master's port serves."""
    with LocalMaster() as master:
        assert master.endpoints is not None
        endpoints = master.endpoints
        with (
            MooncakeStore.open(_settings(endpoints)) as store,
            mock.patch.object(store, "_batch", wraps=store._batch) as to_client,  # each call the client makes
        ):
            assert store.batch_is_exist(["k"]) == [0]
            master.kill()
            store.batch_is_exist(["k"])  # the client finds out: -900 (at once: the connection broke)
            to_client.reset_mock()
            for _ in range(3):
                assert store.batch_is_exist(["k"]) == [Code.RPC_FAILED]
                assert store.get_size("k") == Code.RPC_FAILED
            assert to_client.call_count == 0, "a call went to the client, which spends seconds reconnecting"
            master.start(endpoints)  # returns once it listens
            calls, deadline = 1, time.monotonic() + RECOVERY_GUARD_S
            # the client's first calls may still fail while it reconnects (Mooncake's doing, not ours)
            while (answer := store.batch_is_exist(["k"])) == [Code.RPC_FAILED] and time.monotonic() < deadline:
                calls += 1
                time.sleep(0.05)
            assert to_client.call_count == calls  # from the master's return on, every call went to the client
            assert answer == [0]  # the new master answers; the old one's keys are gone
