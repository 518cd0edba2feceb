"""Faults of the real store under a running save pipeline: a stalled master, a killed one, a dead peer.

Each test spawns its own ``mooncake_master`` (:class:`LocalMaster`), opens a real
client with a short RPC deadline behind a circuit breaker, and runs the default
save graph on a :class:`SyncPipeline` (``when_full="drop"``, a small queue) while a
feeder thread submits a request every couple of milliseconds, as an engine's
step loop would. In the middle of the run the fault strikes; then the test checks
what an engine needs from the connector whatever the store does:

- ``submit`` never blocks (the time it slept is measured around every call);
- every job ends, ok or failed, within its deadline plus the one store call it
  may be caught in, and has released the engine's blocks when it does; the
  entry queue stays bounded;
- within 3 s of the master's (or the segment's) return, new saves are stored;
- stopping the pipeline and closing the store leaves no thread behind and the
  memory where it was.

The 60 s stall of the issue is shortened: with ``rpc_timeout_ms`` at 300 ms a
stall of 3 s is ten RPC deadlines, which is what the bounds depend on (the
breaker stops the calls after ``failures_to_open`` of them; a longer stall only
repeats the open/probe cycle). Latencies and durations are printed (``-s``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import structlog

from kvpipe.connector.bench.peer import remote_segment
from kvpipe.connector.store.breaker import BreakerSettings, CircuitBreaker, GuardedStore
from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster, MasterEndpoints
from kvpipe.pipeline import SyncPipeline
from kvpipe.pipeline.jobs import Job, Outcome
from kvpipe.stages import default_save_graph
from kvpipe.stages.store import Code

from ...stages.kv_fixtures import KVFixture, make_kv, make_request

pytestmark = pytest.mark.mooncake

RPC_TIMEOUT_MS = 300
BREAKER = BreakerSettings(failures_to_open=2, open_s=0.3)
QUEUE_CAPACITY = 32
SUBMIT_EVERY_S = 0.002
TOKENS = 32  # two 16-token blocks: two objects per request
RECOVERY_S = 3.0  # the bound: healthy again within 3 s of the master's return
# Every job has this deadline. A call in flight is never cut short (it may be reading the
# engine's blocks), so a job ends within its deadline plus the longest single call it
# can be caught in, plus scheduling (batching waits, a back-off, 2 busy cores).
JOB_DEADLINE_S = 0.5
SCHEDULING_S = 0.5
# Submit appends to a deque under a lock no store call is made under, and never waits for
# the loop or the store: asserted per call as its time blocked (wall time minus time on a
# CPU or in the run queue). What the code controls is that it never waits for a store
# call, which under these faults lasts the whole RPC deadline (300 ms) or the transfer
# timeout (1 s); what it does not control is the interpreter lock, which the pipeline's
# threads hold up to the 5 ms switch interval each (measured: blocked 1.9, 2.3 and 8.2 ms
# on a busy 2-core machine, with no lock of ours in between). So the bound sits between
# the two: a third of the RPC deadline. Wall times are printed, never asserted.
SUBMIT_BLOCKED_MAX_S = RPC_TIMEOUT_MS / 1000 / 3
# A put to a dead peer's segment fails (-800) after ~1 s, the transfer engine's own
# timeout (not a master RPC: neither MC_RPC_TIMEOUT_MS nor the breaker bound it; the
# put stage's slow-store throttle does).
TRANSFER_FAIL_S = 1.0
RSS_GROWTH_BYTES = 64 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


class ScheduledTime:
    """Seconds this thread was on a CPU or waiting in the run queue for one (its schedstat).

    A submit's wall time minus that is the time it slept: waiting for a lock, the
    GIL or I/O, which is what "blocks" means. The rest is the OS sharing 2 cores
    among this process's threads, the master and the peer: no code of ours waits.
    """

    def __init__(self) -> None:
        self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)  # of the calling thread

    def seconds(self) -> float:
        on_cpu, in_run_queue, _ = os.pread(self._fd, 128, 0).split()
        return (int(on_cpu) + int(in_run_queue)) / 1e9


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
    tensors = [t for layers in fixture.tensors.values() for t in layers]
    for t in tensors:
        assert store.register_buffer(t.data_ptr(), t.numel() * t.element_size()) == 0
    pipeline = SyncPipeline(
        default_save_graph(fixture.kv, store),
        queue_capacity=QUEUE_CAPACITY,
        when_full="drop",
        name="faults",
        job_deadline_s=JOB_DEADLINE_S,
    ).start()
    feeder = Feeder(pipeline, fixture)
    feeder.start()
    run = Run(master, store, fixture, pipeline, feeder)
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
        f"\n  job s: p50={durations[len(durations) // 2]:.3f} p99={durations[int(0.99 * (len(durations) - 1))]:.3f}"
        f" max={durations[-1]:.3f}"
        f"\n  marks (s after the fault): { {k: round(v - t0, 3) for k, v in run.marks.items()} }"
        f" blocked max={max(run.feeder.blocked) * 1e6:.0f}us"
        f"\n  slowest submits (s after the fault, wall us, blocked us): {slowest}"
        f"\n  python threads {threads_before}->{threads_after}, native threads {native_before}->{native_after},"
        f" rss {rss_before >> 20}->{rss_after >> 20} MiB"
    )
    assert threads_after <= threads_before, "a Python thread outlived the pipeline and the store"
    assert native_after <= native_before + 2, "native threads outlived the store"
    assert rss_after - rss_before < RSS_GROWTH_BYTES


def check_jobs(run: Run, longest_call_s: float) -> None:
    """Every job ended within its deadline (plus one call), released; the entry never overfilled;
    submit never blocked."""
    job_bound_s = JOB_DEADLINE_S + longest_call_s + SCHEDULING_S
    jobs = run.feeder.jobs
    assert jobs and all(job.done for job in jobs)
    assert all(job.released for job in jobs)
    slow = [
        (job.id, round(job.elapsed_s or 0, 3), dict(job.counts))
        for job in jobs
        if (job.elapsed_s or 0) > job_bound_s
    ]
    assert not slow, f"{len(slow)} jobs outlived {job_bound_s:.2f} s: {slow[:5]}"
    assert run.feeder.max_queued <= QUEUE_CAPACITY
    assert max(run.feeder.blocked) < SUBMIT_BLOCKED_MAX_S


def recovery(run: Run, since: float) -> float:
    took = run.wait_for_saves(since, RECOVERY_S)
    run.mark("stored again")
    assert took <= RECOVERY_S, (
        f"no save stored within {RECOVERY_S} s of the store's return (took {took:.2f} s)"
    )
    return took


@pytest.fixture(scope="module", autouse=True)
def _native_singletons() -> None:
    """Open and close one client first: the library keeps a few process-wide threads from then on."""
    with LocalMaster() as first, MooncakeStore.open(_settings(first.endpoints)) as store:  # type: ignore[arg-type]
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
        master.pause()
        time.sleep(10 * _rpc_timeout_s())
        master.resume()
        run.mark("back")
        recovery(run, run.marks["back"])
        time.sleep(0.5)
    # A call to the stopped master lasts one RPC deadline; then the breaker fails calls fast.
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
    # A call made as the new master comes up can wait for it (~1.1 s).
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
    # -800 is the store working, so the breaker stays closed and each put call costs
    # TRANSFER_FAIL_S; the put stage's throttle sheds the puts after the first few.
    (put,) = [spec.stage for spec in run.pipeline.graph.specs if spec.name == "put"]
    assert put.throttle.slow_spells >= 1
    assert sum(job.counts["throttled"] for job in run.feeder.jobs) > 0
    check_jobs(run, longest_call_s=TRANSFER_FAIL_S)


def test_while_a_killed_master_is_down_calls_fail_at_once_not_after_4_s() -> None:
    """The client spends ~4.5 s per call reconnecting to a dead master; the store answers -900 itself."""
    with LocalMaster() as master:
        assert master.endpoints is not None
        endpoints = master.endpoints
        with MooncakeStore.open(_settings(endpoints)) as store:
            assert store.batch_is_exist(["k"]) == [0]
            master.kill()
            store.batch_is_exist(["k"])  # the client finds out: -900 (at once: the connection broke)
            for _ in range(3):
                started = time.monotonic()
                assert store.batch_is_exist(["k"]) == [Code.RPC_FAILED]
                assert store.get_size("k") == Code.RPC_FAILED
                assert time.monotonic() - started < _rpc_timeout_s()
            master.start(endpoints)
            started = time.monotonic()
            while (answer := store.batch_is_exist(["k"])) == [Code.RPC_FAILED]:
                assert time.monotonic() - started < RECOVERY_S
                time.sleep(0.05)
            assert answer == [0]  # the new master answers; the old one's keys are gone
