"""Faults in a running fleet: a replica, a store node, the leading master, each killed while requests flow.

Each test starts a fleet (two ``vllm serve`` replicas with kvpipe behind vLLM's round
robin router) and a steady :class:`~.client.Traffic` through the router: pairs of equal
prompts, the second of each landing on the other replica, so it hits only through the
store and must answer as the first did. Before the fault, probe prompts are computed
on replica 0 (straight to it) and stored; after it, they are asked of replica 1,
which never computed them: a hit there is the store's. What every fault must leave
true: no request failed (a load the store fails is recomputed), every pair answered
alike, and the probes' answers equal their first ones. The figures (hits of the
probes, the gap until the traffic hits again, TTFT p99 through it) are printed.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpipe.connector.engines import launch
from kvpipe.connector.fleet.fleet import Fleet, FleetSpec
from kvpipe.connector.fleet.network import why_unavailable

from .client import Answer, Traffic, complete, words

pytestmark = [pytest.mark.mooncake, pytest.mark.engine]

BLOCK = 128
PROBES = 6
PROBE_TOKENS = 3 * BLOCK + 40  # three whole blocks and a tail
WHOLE = 3 * BLOCK
SAVED_WITHIN_S = 30.0
CLIENT_TTL_S = 10  # Mooncake's default: the master drops a dead client's segment after it
PARTITION_S = 8.0  # shorter than the client TTL: the master keeps the cut node's segment
HITS_RESUME_WITHIN_S = 90.0
#: Mooncake's own failover: the standby's lease wait (~5 s) and election, longer on a busy machine
STANDBY_LEADS_WITHIN_S = 180.0
ALL_HIT_WITHIN_S = 90.0
#: No request waits on the store beyond a load's deadline (kvpipe's load_deadline_s, 5 s), where
#: a request stuck behind a stalled store call would wait Mooncake's RPC deadline (30 s) or the
#: kernel's connect timeout (longer); compute here is ~0.1 s a request. The bound sits between
#: them, leaving 20 s for a busy machine: it tells a deadline kept from a stall, not a slow machine.
STALL_BOUND_S = 25.0


@dataclass
class Running:
    fleet: Fleet
    traffic: Traffic
    probes: dict[str, Answer]  # prompt -> its answer on replica 0

    @property
    def model(self) -> str:
        return str(self.fleet.model)

    def stored_objects(self) -> int:
        """Objects the store holds now (the leading master's admin HTTP)."""
        fleet = self.fleet
        master = fleet.master if fleet.cluster is None else fleet.cluster.leader()
        if master is None or master.endpoints is None:
            return 0
        try:
            return len(launch.stored_keys(master.endpoints))
        except OSError:
            return 0

    def ask_replica_1(self) -> list[Answer]:
        """Every probe, straight to replica 1 (which never computed one)."""
        return [complete(self.fleet.replicas[1].url, self.model, prompt) for prompt in self.probes]

    def until_every_probe_hits(self, timeout_s: float = ALL_HIT_WITHIN_S) -> list[Answer]:
        """:meth:`ask_replica_1` until every probe hits whole (the last answers at the deadline).

        How soon depends on the master: it drops a dead node's copies after its client TTL,
        and a busy machine stretches that (measured 10-45 s).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            answers = self.ask_replica_1()
            if all(a.cached_tokens >= WHOLE for a in answers) or time.monotonic() >= deadline:
                return answers
            time.sleep(2.0)

    def store_events(self) -> str:
        """What the replicas logged of the store's state (circuit, throttle) and the masters' last lines: a failure's context."""
        marks = ("circuit", "store slow", "store fast", "item failed")
        tails = []
        for replica in self.fleet.replicas:
            log = replica.process.log_path
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            tails += [f"{replica.name}: {line}" for line in lines if any(m in line for m in marks)][-20:]
        masters = [] if self.fleet.cluster is None else self.fleet.cluster.masters
        tails += [f"master {master.endpoints}: {master.log_tail(8)}" for master in masters]
        return "\n".join(tails)

    def wait_for_hits(self, since: float, timeout_s: float) -> float:
        """Seconds from ``since`` until the traffic hits again: the first pair's second request
        that hits after one that missed (0 when none missed: the fault cost no hit)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seconds = [s for s in list(self.traffic.sent) if s.second and s.started >= since and s.answer]
            missed = next((s.started for s in seconds if s.answer and s.answer.cached_tokens == 0), None)
            if missed is None and len(seconds) >= 3:
                return 0.0
            if missed is not None and (hits := self.traffic.hits(missed)):
                return hits[0].started - since
            time.sleep(0.2)
        return float("inf")


@contextmanager
def started(spec: FleetSpec) -> Iterator[Fleet]:
    """The fleet of ``spec``; a test that needs network namespaces where this machine cannot make them
    skips, saying why. A failing ``ip`` command where they can be made is an error: the test fails."""
    if spec.network_namespaces and (reason := why_unavailable()) is not None:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    with Fleet(spec) as fleet:
        yield fleet


@contextmanager
def running(tmp_path: Path, **spec: object) -> Iterator[Running]:
    with started(FleetSpec.model_validate({"replicas": 2, "log_dir": tmp_path, **spec})) as fleet:
        traffic = Traffic(fleet.url, str(fleet.model)).start()
        try:
            model = str(fleet.model)
            probes = {
                prompt: complete(fleet.replicas[0].url, model, prompt)
                for prompt in (words(seed=900 + i, count=PROBE_TOKENS) for i in range(PROBES))
            }
            run = Running(fleet, traffic, probes)
            deadline = time.monotonic() + SAVED_WITHIN_S
            while run.stored_objects() < PROBES * 3:
                assert time.monotonic() < deadline, "the probes' saves never landed"
                time.sleep(0.2)
            time.sleep(1.0)  # some traffic before the fault
            yield run
        finally:
            traffic.stop()


def report(name: str, run: Running, fault: float, probes: list[Answer], gap_s: float) -> None:
    hits = sum(1 for a in probes if a.cached_tokens >= WHOLE)
    sent = run.traffic.sent
    print(
        f"\n{name}: requests {len(sent)} failed {len(run.traffic.failed())}, pairs unequal "
        f"{len(run.traffic.unequal_pairs())}; probes hit on replica 1 after it: {hits}/{PROBES}; "
        f"traffic hits again {gap_s:.1f} s after it; TTFT p99 before "
        f"{run.traffic.ttft_p99(0, fault) * 1e3:.0f} ms, in the 30 s after "
        f"{run.traffic.ttft_p99(fault, fault + 30) * 1e3:.0f} ms"
    )


def check(run: Running, probes: list[Answer]) -> None:
    assert run.traffic.failed() == []
    assert run.traffic.unequal_pairs() == []
    assert max(s.answer.ttft_s for s in run.traffic.sent if s.answer) < STALL_BOUND_S
    assert [a.text for a in probes] == [a.text for a in run.probes.values()]


def test_a_killed_replicas_traffic_goes_to_the_other_and_what_it_stored_still_hits(tmp_path: Path) -> None:
    with running(tmp_path) as run:
        fault = run.traffic.between_requests(lambda: run.fleet.replicas[0].process.signal(signal.SIGKILL))
        time.sleep(5.0)
        # through the router now: only replica 1 is left to answer
        probes = [complete(run.fleet.url, run.model, prompt) for prompt in run.probes]
        time.sleep(2.0)
        report("replica killed", run, fault, probes, 0.0)
        check(run, probes)
        assert [a.cached_tokens for a in probes] == [WHOLE] * PROBES
        assert len([s for s in run.traffic.sent if s.started > fault]) >= 4  # it went on through the router


def test_a_killed_store_node_loses_nothing_when_every_object_has_two_copies(tmp_path: Path) -> None:
    with running(tmp_path, store_nodes=2, copies=2) as run:
        fault = time.monotonic()
        run.fleet.store_nodes[0].kill()
        time.sleep(2.0)
        early = run.ask_replica_1()  # within the master's client TTL: the dead copies still listed
        time.sleep(CLIENT_TTL_S)
        probes = run.until_every_probe_hits()
        gap = run.wait_for_hits(fault, HITS_RESUME_WITHIN_S)
        report("store node killed, 2 copies", run, fault, probes, gap)
        print(f"  probes hit {sum(1 for a in early if a.cached_tokens >= WHOLE)}/{PROBES} 2 s after it")
        check(run, probes)
        assert [a.text for a in early] == [a.text for a in run.probes.values()]
        assert [a.cached_tokens for a in probes] == [WHOLE] * PROBES


def test_a_killed_store_node_with_one_copy_costs_misses_never_a_wrong_answer(tmp_path: Path) -> None:
    with running(tmp_path, store_nodes=2, copies=1) as run:
        fault = time.monotonic()
        run.fleet.store_nodes[0].kill()
        time.sleep(2.0)
        early = run.ask_replica_1()
        time.sleep(CLIENT_TTL_S + 2)
        probes = run.ask_replica_1()
        gap = run.wait_for_hits(fault, HITS_RESUME_WITHIN_S)
        report("store node killed, 1 copy", run, fault, probes, gap)
        check(run, probes)
        assert [a.text for a in early] == [a.text for a in run.probes.values()]
        assert gap < HITS_RESUME_WITHIN_S, run.store_events()  # new saves land on the node that is left


def test_the_leading_master_killed_serves_by_recompute_and_hits_resume(tmp_path: Path) -> None:
    with running(tmp_path, masters=2, store_nodes=1) as run:
        cluster = run.fleet.cluster
        assert cluster is not None
        leader = cluster.leader()
        assert leader is not None
        fault = time.monotonic()
        leader.kill()
        # how soon the standby leads is Mooncake's; what kvpipe owns is the time after it
        cluster.wait_for_leader(STANDBY_LEADS_WITHIN_S)
        leads = time.monotonic()
        gap = run.wait_for_hits(leads, HITS_RESUME_WITHIN_S)
        probes = run.until_every_probe_hits()
        report("leading master killed", run, fault, probes, gap)
        print(f"  the standby served {leads - fault:.1f} s after it")
        check(run, probes)
        assert gap < HITS_RESUME_WITHIN_S, run.store_events()
        assert [a.cached_tokens for a in probes] == [WHOLE] * PROBES  # the standby kept every object


def test_a_store_node_partitioned_and_back_costs_no_request_and_no_wrong_answer(tmp_path: Path) -> None:
    """Every replica and store node in a network namespace of its own; one node's link goes down."""
    with running(tmp_path, store_nodes=2, copies=2, network_namespaces=True) as run:
        network = run.fleet.network
        assert network is not None and len(run.fleet.node_hosts) == 2
        fault = time.monotonic()
        network.cut(run.fleet.node_hosts[0])
        time.sleep(PARTITION_S)
        during = run.ask_replica_1()  # the cut node's copies cannot be read: the other copy, or recompute
        network.restore(run.fleet.node_hosts[0])
        probes = run.until_every_probe_hits()
        gap = run.wait_for_hits(fault, HITS_RESUME_WITHIN_S)
        report(f"store node partitioned for {PARTITION_S:g} s, 2 copies", run, fault, probes, gap)
        print(f"  probes hit {sum(1 for a in during if a.cached_tokens >= WHOLE)}/{PROBES} during it")
        check(run, probes)
        assert [a.text for a in during] == [a.text for a in run.probes.values()]
        assert gap < HITS_RESUME_WITHIN_S, run.store_events()
        assert [a.cached_tokens for a in probes] == [WHOLE] * PROBES  # nothing lost
