"""A fleet on real processes: two ``vllm serve`` replicas behind vLLM's router over one store.

Round robin sends consecutive requests to different replicas, so the second request
of a prompt lands on the replica that did not compute it: its hit can only come from
what the first replica stored. The tests only read the fleet, so the module shares one
(its replicas publish KV events, for the ``kv_aware`` test); each test puts the router
policy it needs in front, sends prompts of its own and counts from where it started.
When the module ends, no process the fleet started may outlive it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import psutil
import pytest

from kvpipe.connector.engines import launch
from kvpipe.connector.fleet.fleet import Fleet, FleetSpec
from kvpipe.connector.fleet.replica import core_shares

from .client import EXTERNAL_HITS, complete, counter, words

pytestmark = [pytest.mark.mooncake, pytest.mark.engine]

BLOCK = 128  # the tiny Llama's block size on the CPU build
PROMPT_TOKENS = 600
SAVED_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    spec = FleetSpec(replicas=2, kv_events=True, log_dir=tmp_path_factory.mktemp("fleet"))
    with Fleet(spec) as running:
        started = set(running.processes())
        yield running
    assert not [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def stored(fleet: Fleet) -> int:
    """How many objects the fleet's store holds now."""
    assert fleet.master is not None and fleet.master.endpoints is not None
    return len(launch.stored_keys(fleet.master.endpoints))


def wait_for_keys(fleet: Fleet, count: int) -> float:
    """Seconds until the store holds ``count`` objects (a save lands at the save pipeline's pace)."""
    started = time.monotonic()
    while stored(fleet) < count:
        assert time.monotonic() - started < SAVED_WITHIN_S, "the first replica's save never landed"
        time.sleep(0.2)
    return time.monotonic() - started


def test_a_prefix_stored_through_one_replica_hits_on_the_other_with_equal_outputs(fleet: Fleet) -> None:
    fleet.use_policy("round_robin")
    model = str(fleet.model)
    prompt = words(seed=1, count=PROMPT_TOKENS)
    hits_before = [counter(r.url, EXTERNAL_HITS) for r in fleet.replicas]
    objects_before = stored(fleet)
    first = complete(fleet.url, model, prompt, max_tokens=8)
    whole_blocks = PROMPT_TOKENS // BLOCK
    landed = wait_for_keys(fleet, objects_before + whole_blocks)
    second = complete(fleet.url, model, prompt, max_tokens=8)
    hits = [counter(r.url, EXTERNAL_HITS) - before for r, before in zip(fleet.replicas, hits_before, strict=True)]
    print(f"\nfleet: save landed {landed:.2f} s after the first answer; external hits per replica {hits}")
    assert first.prompt_tokens == second.prompt_tokens == PROMPT_TOKENS
    assert first.cached_tokens == 0
    assert second.cached_tokens == whole_blocks * BLOCK
    assert sorted(hits) == [0, whole_blocks * BLOCK]  # one replica computed, the other loaded
    assert second.text == first.text


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
def test_each_replica_engine_runs_on_cores_of_its_own(fleet: Fleet) -> None:
    pids = [r.process.pid for r in fleet.replicas]
    bound = [engine_cores(pid) for pid in pids if pid is not None]
    shares = core_shares(sorted(psutil.Process().cpu_affinity()), 2)
    assert bound == [{frozenset(share)} for share in shares]


def test_under_kv_aware_the_router_takes_each_replicas_stream_and_the_pools(fleet: Fleet) -> None:
    fleet.use_policy("kv_aware")
    model = str(fleet.model)
    prompt = words(seed=2, count=PROMPT_TOKENS)
    assert fleet.relay is not None
    relayed_before, objects_before = fleet.relay.relayed, stored(fleet)
    first = complete(fleet.replicas[0].url, model, prompt, max_tokens=8)
    wait_for_keys(fleet, objects_before + PROMPT_TOKENS // BLOCK)
    # the stored chunks' events ride on the writer's engine steps (its workers' reports
    # reach its scheduler with a step's output): give it steps until they are out
    deadline = time.monotonic() + SAVED_WITHIN_S
    while fleet.relay.relayed - relayed_before < PROMPT_TOKENS // BLOCK and time.monotonic() < deadline:
        complete(fleet.replicas[0].url, model, words(seed=3, count=8), max_tokens=1)
        time.sleep(0.2)
    relayed = fleet.relay.relayed - relayed_before
    again = [complete(fleet.url, model, prompt, max_tokens=8) for _ in range(3)]
    log = (fleet.log_dir / "router-kv_aware.log").read_text(errors="replace")
    assert [a.text for a in again] == [first.text] * 3
    assert [a.cached_tokens for a in again] == [PROMPT_TOKENS // BLOCK * BLOCK] * 3
    assert relayed >= PROMPT_TOKENS // BLOCK  # the chunks replica 0 stored, to every worker's stream
    assert "discovery failed" not in log
    for served in fleet.replicas:
        assert log.count(f"kv_index subscriber for {served.url}") == 2  # its own stream and the pool's
