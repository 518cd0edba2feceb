"""A fleet on real processes: two ``vllm serve`` replicas behind vLLM's router over one store.

Round robin sends consecutive requests to different replicas, so the second request
of a prompt lands on the replica that did not compute it: its hit can only come from
what the first replica stored. Each test starts its own fleet and checks that no
process it started outlives it.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import psutil
import pytest

from kvpipe.connector.engines import launch
from kvpipe.connector.fleet.fleet import Fleet, FleetSpec
from kvpipe.connector.fleet.replica import core_shares

from .client import EXTERNAL_HITS, complete, counter, words

pytestmark = pytest.mark.mooncake

BLOCK = 128  # the tiny Llama's block size on the CPU build
PROMPT_TOKENS = 600
SAVED_WITHIN_S = 30.0


def wait_for_keys(fleet: Fleet, count: int) -> float:
    """Seconds until the store holds ``count`` objects (a save lands at the save pipeline's pace)."""
    assert fleet.master is not None and fleet.master.endpoints is not None
    started = time.monotonic()
    while len(launch.stored_keys(fleet.master.endpoints)) < count:
        assert time.monotonic() - started < SAVED_WITHIN_S, "the first replica's save never landed"
        time.sleep(0.2)
    return time.monotonic() - started


def test_a_prefix_stored_through_one_replica_hits_on_the_other_with_equal_outputs(tmp_path: Path) -> None:
    spec = FleetSpec(replicas=2, policy="round_robin", log_dir=tmp_path)
    with Fleet(spec) as fleet:
        model = str(fleet.model)
        prompt = words(seed=1, count=PROMPT_TOKENS)
        first = complete(fleet.url, model, prompt, max_tokens=8)
        whole_blocks = PROMPT_TOKENS // BLOCK
        landed = wait_for_keys(fleet, whole_blocks)
        second = complete(fleet.url, model, prompt, max_tokens=8)
        hits = [counter(r.url, EXTERNAL_HITS) for r in fleet.replicas]
        started = {p for p in fleet.processes()}
    print(f"\nfleet: save landed {landed:.2f} s after the first answer; external hits per replica {hits}")
    assert first.prompt_tokens == second.prompt_tokens == PROMPT_TOKENS
    assert first.cached_tokens == 0
    assert second.cached_tokens == whole_blocks * BLOCK
    assert sorted(hits) == [0, whole_blocks * BLOCK]  # one replica computed, the other loaded
    assert second.text == first.text
    assert not [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def engine_cores(served_pid: int) -> set[frozenset[int]]:
    """The CPU sets a replica's processes run on, where narrower than the machine's (its bound engine)."""
    machine = set(psutil.Process().cpu_affinity())
    found = set()
    for process in psutil.Process(served_pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            cores = set(process.cpu_affinity())
            if cores != machine:
                found.add(frozenset(cores))
    return found


@pytest.mark.skipif(len(psutil.Process().cpu_affinity()) < 2, reason="one core: nothing to share out")
def test_each_replica_engine_runs_on_cores_of_its_own(tmp_path: Path) -> None:
    with Fleet(FleetSpec(replicas=2, log_dir=tmp_path)) as fleet:
        pids = [r.process.pid for r in fleet.replicas]
        bound = [engine_cores(pid) for pid in pids if pid is not None]
    shares = core_shares(sorted(psutil.Process().cpu_affinity()), 2)
    assert bound == [{frozenset(share)} for share in shares]


def test_under_kv_aware_the_router_takes_each_replicas_stream_and_the_pools(tmp_path: Path) -> None:
    spec = FleetSpec(replicas=2, policy="kv_aware", log_dir=tmp_path)
    with Fleet(spec) as fleet:
        model = str(fleet.model)
        prompt = words(seed=2, count=PROMPT_TOKENS)
        first = complete(fleet.replicas[0].url, model, prompt, max_tokens=8)
        wait_for_keys(fleet, PROMPT_TOKENS // BLOCK)
        # the stored chunks' events ride on the writer's engine steps (its workers' reports
        # reach its scheduler with a step's output): give it steps until they are out
        assert fleet.relay is not None
        deadline = time.monotonic() + SAVED_WITHIN_S
        while fleet.relay.relayed < PROMPT_TOKENS // BLOCK and time.monotonic() < deadline:
            complete(fleet.replicas[0].url, model, words(seed=3, count=8), max_tokens=1)
            time.sleep(0.2)
        relayed = fleet.relay.relayed
        again = [complete(fleet.url, model, prompt, max_tokens=8) for _ in range(3)]
        log = (tmp_path / "router-kv_aware.log").read_text(errors="replace")
    assert [a.text for a in again] == [first.text] * 3
    assert [a.cached_tokens for a in again] == [PROMPT_TOKENS // BLOCK * BLOCK] * 3
    assert relayed >= PROMPT_TOKENS // BLOCK  # the chunks replica 0 stored, to every worker's stream
    assert "discovery failed" not in log
    for served in fleet.replicas:
        assert log.count(f"kv_index subscriber for {served.url}") == 2  # its own stream and the pool's
