"""The real vLLM engine on a Mooncake HA cluster through a leader failover.

The engine mounts no segment; a store node of the session's cluster (etcd, two HA
masters, shared with tests/connector: one etcd per process) holds its objects. The
leader is killed with the engine's saves durable in the operation log; generation
goes on during the gap with identical outputs, and once a standby leads, the
prefixes stored before hit and load. Figures are printed (``pytest -s``).
"""

from __future__ import annotations

import time

import pytest

from kvpipe.connector.engines.launch import close_llm, kvpipe_transfer
from kvpipe.connector.store.mooncake import harness
from kvpipe.connector.store.mooncake.cluster import LocalCluster
from kvpipe.connector.store.mooncake.master import P2P_HANDSHAKE

from . import engine

pytestmark = pytest.mark.mooncake

STORED_SEED = 3  # stored before the failover, loaded after it
GAP_SEEDS = (4, 5)  # first seen during the gap: generated, their saves fail fast


def test_vllm_generates_through_a_leader_failover_and_then_hits_what_it_stored(
    cluster: LocalCluster, reference: dict[int, list[list[int]]]
) -> None:
    node = cluster.add_store_node("256MB")
    store = {
        "kind": "mooncake",
        "master": cluster.master_address,
        "metadata_server": P2P_HANDSHAKE,
        "global_segment_size": 0,
        "rpc_timeout_ms": 500,
    }
    transfer = kvpipe_transfer({"store": store}, load_failure_policy="recompute")
    llm = engine.make_llm(transfer)
    old = cluster.leader()
    assert old is not None and old.endpoints is not None
    try:
        batch = engine.prompts(STORED_SEED)
        before = len(engine.worker(llm).observed)
        first = engine.generate(llm, batch)
        assert engine.worker(llm).drain(10.0)
        keys = {
            record.key
            for record, status in list(engine.worker(llm).observed)[before:]
            if status.value == "put"
        }
        assert first["tokens"] == reference[STORED_SEED] and keys
        deadline = time.monotonic() + 10  # the leader's group commit: a few ms
        while not keys <= harness.durable_puts(cluster) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert keys <= harness.durable_puts(cluster)

        killed = time.monotonic()
        old.kill()
        gap = []
        for seed in GAP_SEEDS:  # the gap: no leader; the engine must not notice but in its cache
            assert llm.reset_prefix_cache()
            out = engine.generate(llm, engine.prompts(seed))
            gap.append(out["seconds"])
            assert out["tokens"] == reference[seed]
        cluster.wait_for_leader(timeout_s=60)
        led = time.monotonic()

        # Once the new leader serves (and the breakers let a probe through), the prefixes
        # stored before the failover hit and load; every pass meanwhile is still correct.
        hit = None
        while hit is None and time.monotonic() - led < 60:
            assert llm.reset_prefix_cache()
            out = engine.generate(llm, batch)
            assert out["tokens"] == reference[STORED_SEED]
            if out["cached"] == [engine.FULL_HIT] * len(batch):
                hit = time.monotonic()
            else:
                time.sleep(0.5)
        assert hit is not None, "the prefixes stored before the failover never hit after it"
        print(
            f"\nvLLM through a failover: passes during the gap took {', '.join(f'{s:.2f}' for s in gap)} s "
            f"(first pass {first['seconds']:.2f} s); new leader after {led - killed:.1f} s; "
            f"stored prefixes hit {hit - killed:.1f} s after the kill"
        )
    finally:
        close_llm(llm)
        if old.pid is None:
            old.start(old.endpoints)
        node.stop()
        cluster.store_nodes.remove(node)
