"""``kvpipe run`` on a Mooncake cluster: the shipped config spawns one, and a run after a failover puts nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore, harness
from kvpipe.connector.store.mooncake.cluster import LocalCluster
from kvpipe.connector.store.mooncake.master import P2P_HANDSHAKE

pytestmark = pytest.mark.mooncake

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "cluster.yaml"


def _run(*sets: str, dump: Path | None = None) -> dict:
    args = [sys.executable, "-m", "kvpipe.connector.cli.main", "run", str(CONFIG), "--json"]
    args += [f"--set={assignment}" for assignment in ("workload.requests=24", *sets)]
    if dump is not None:
        args += ["--dump-objects", str(dump)]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_cluster_config_spawns_a_cluster_runs_on_it_and_leaves_no_process() -> None:
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    report = _run()
    assert report["verify"]["mismatches"] == 0
    assert report["objects"]["put"] > 0 and report["objects"]["failed"] == 0
    assert {child.pid for child in psutil.Process().children(recursive=True)} - before == set()


def test_a_run_after_a_leader_failover_finds_every_object_and_puts_none(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    node = cluster.add_store_node("256MB")
    on_session_cluster = ("store.cluster=null", f"store.master={cluster.master_address}", "store.replicas=1")
    old = cluster.leader()
    assert old is not None and old.endpoints is not None
    try:
        first = _run(*on_session_cluster, dump=tmp_path / "objects.jsonl")
        objects = [json.loads(line) for line in (tmp_path / "objects.jsonl").read_text().splitlines()]
        keys = [found["key"] for found in objects if found["status"] == "put"]
        assert first["objects"]["put"] > 0 and keys
        assert set(keys) <= harness.durable_puts(cluster)  # a run's close takes seconds: long durable
        old.kill()
        cluster.wait_for_leader(timeout_s=60)
        _wait_until_all_exist(cluster, keys)  # the new leader has the log and the node's segment
        second = _run(*on_session_cluster)
    finally:
        if old.pid is None:
            old.start(old.endpoints)
        node.stop()
        cluster.store_nodes.remove(node)
    assert second["objects"]["put"] == 0
    assert second["objects"]["existing"] == second["objects"]["considered"] == first["objects"]["considered"]
    assert second["verify"]["mismatches"] == 0


def _wait_until_all_exist(cluster: LocalCluster, keys: list[str], timeout_s: float = 30.0) -> None:
    settings = MooncakeSettings(
        master=cluster.master_address,
        metadata_server=P2P_HANDSHAKE,
        global_segment_size=0,
        local_buffer_size="16MB",
    )
    with MooncakeStore.open(settings) as probe:
        deadline = time.monotonic() + timeout_s
        while probe.batch_is_exist(keys) != [1] * len(keys):
            assert time.monotonic() < deadline, "objects stored before the failover did not come back"
            time.sleep(0.2)
