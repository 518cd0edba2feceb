"""Mooncake's HA cluster on loopback: addresses as Mooncake has them, and a local cluster that cleans up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.cluster import LocalCluster
from kvpipe.connector.store.mooncake.master import LocalMaster, MasterError, free_port
from kvpipe.connector.store.mooncake.master_address import (
    CLUSTER_ID_ENV,
    MasterAddress,
    etcd_range,
    leader_key,
)

ROOT = Path(__file__).resolve().parents[4]


# -- addresses (no processes) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "endpoints"),
    [
        ("10.0.0.5:50051", "direct", (("10.0.0.5", 50051),)),
        ("etcd://10.0.0.1:2379", "etcd", (("10.0.0.1", 2379),)),
        ("etcd://h1:2379;h2:2379;h3:2380", "etcd", (("h1", 2379), ("h2", 2379), ("h3", 2380))),
        ("redis://user:secret@cache:6379", "redis", (("cache", 6379),)),
    ],
)
def test_a_master_address_may_be_one_master_or_an_ha_cluster(text: str, kind: str, endpoints: tuple) -> None:
    address = MasterAddress.parse(text)
    assert (address.kind, address.endpoints, address.text) == (kind, endpoints, text)
    assert MooncakeSettings(master=text, metadata_server="P2PHANDSHAKE").master == text


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("zk://h:1", "scheme 'zk'"),
        ("etcd://", "names no etcd endpoint"),
        ("etcd://h1:2379;h2", "must be"),
        ("redis://cache", "with a host and a port"),
    ],
)
def test_a_bad_master_address_names_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        MooncakeSettings(master=text, metadata_server="P2PHANDSHAKE")
    message = str(caught.value)
    assert "master" in message and says in message and "etcd://" in message


def test_an_etcd_address_with_no_etcd_listening_fails_in_seconds_with_one_line() -> None:
    port = free_port()
    settings = MooncakeSettings(
        master=f"etcd://127.0.0.1:{port}", metadata_server="P2PHANDSHAKE", connect_timeout_s=0.5
    )
    started = time.monotonic()
    with pytest.raises(MasterError) as caught:
        MooncakeStore.open(settings)
    assert time.monotonic() - started < 20.0  # the client's own set-up retries for ~90 s
    message = str(caught.value)
    assert (
        "\n" not in message
        and f"etcd://127.0.0.1:{port}" in message
        and "no etcd endpoint listens" in message
    )


# -- a real cluster --------------------------------------------------------------------------

pytestmark_real = pytest.mark.mooncake


def _client(cluster: LocalCluster, segment: str = "64MB") -> MooncakeStore:
    settings = MooncakeSettings(
        master=cluster.master_address,
        metadata_server="P2PHANDSHAKE",
        global_segment_size=segment,
        rpc_timeout_ms=500,
    )
    return MooncakeStore.open(settings)


@pytestmark_real
def test_a_client_joins_the_cluster_through_etcd_and_its_leader(cluster: LocalCluster) -> None:
    leader = cluster.leader()
    assert leader is not None and leader in cluster.masters
    standby = [m for m in cluster.masters if m is not leader]
    assert standby and all(m.pid is not None for m in standby)  # running, standing by
    with _client(cluster) as store:
        value = bytearray(b"kv" * 512)
        import ctypes

        address = ctypes.addressof((ctypes.c_char * len(value)).from_buffer(value))
        assert store.register_buffer(address, len(value)) == 0
        assert store.batch_put_from(["cluster-k"], [address], [len(value)], store.new_replicate_config()) == [
            0
        ]
        assert store.batch_is_exist(["cluster-k", "absent"]) == [1, 0]
        store.unregister_buffer(address)


@pytestmark_real
def test_in_an_etcd_shared_by_clusters_the_leader_is_that_of_the_cluster_this_process_joins(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another cluster's leader ("another" is listed before "mooncake_cluster") says nothing of ours."""
    assert cluster.etcd_port is not None
    address = MasterAddress.parse(cluster.master_address)
    ours = cluster.leader()
    assert ours is not None and ours.endpoints is not None
    with LocalMaster(etcd_endpoints=f"127.0.0.1:{cluster.etcd_port}", cluster_id="another") as other:
        assert other.endpoints is not None
        deadline = time.monotonic() + 30
        while not etcd_range("127.0.0.1", cluster.etcd_port, leader_key("another"), timeout_s=1.0):
            assert time.monotonic() < deadline, "the other cluster's master never led"
            time.sleep(0.1)
        assert address.leader(timeout_s=1.0) == ("127.0.0.1", ours.endpoints.rpc_port)
        monkeypatch.setenv(CLUSTER_ID_ENV, "another")  # a process that joins the other cluster
        assert address.leader(timeout_s=1.0) == ("127.0.0.1", other.endpoints.rpc_port)


@pytestmark_real
def test_a_local_cluster_leads_the_cluster_its_owners_clients_join(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CLUSTER_ID_ENV, "tenant-a")
    with LocalCluster(masters=1) as tenant:  # it returns once a master leads: it would raise otherwise
        assert tenant.etcd_port is not None
        recorded = etcd_range("127.0.0.1", tenant.etcd_port, b"mooncake-store/", timeout_s=1.0) or []
        assert [key for key, _ in recorded] == [leader_key("tenant-a")]


@pytestmark_real
def test_an_ha_master_leads_by_default_the_cluster_its_owners_clients_join(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cluster.etcd_port is not None
    monkeypatch.setenv(CLUSTER_ID_ENV, "tenant-b")
    with LocalMaster(etcd_endpoints=f"127.0.0.1:{cluster.etcd_port}") as master:
        assert master.endpoints is not None
        deadline = time.monotonic() + 30
        while not etcd_range("127.0.0.1", cluster.etcd_port, leader_key("tenant-b"), timeout_s=1.0):
            assert time.monotonic() < deadline, "the master never led tenant-b"
            time.sleep(0.1)
        assert MasterAddress.parse(cluster.master_address).leader(timeout_s=1.0) == (
            "127.0.0.1",
            master.endpoints.rpc_port,
        )


@pytestmark_real
def test_a_process_joins_one_etcd_cluster_only(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mooncake's client keeps one etcd connection per process: a second one is a one-line error."""
    from kvpipe.connector.store.mooncake.registry import REGISTRY

    monkeypatch.setattr(REGISTRY, "joined_etcd", (("127.0.0.1", 1),))
    with pytest.raises(MasterError) as caught:
        _client(cluster)
    message = str(caught.value)
    assert (
        "\n" not in message and "etcd://127.0.0.1:1 already" in message and cluster.master_address in message
    )


def _descendants() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


@pytestmark_real
def test_a_cluster_that_cannot_start_leaves_no_process_behind() -> None:
    before = _descendants()
    with pytest.raises(MasterError, match="no mooncake master leads"):
        with LocalCluster(masters=1, startup_timeout_s=0.5):  # the election takes ~5 s
            pass
    assert _descendants() - before == set()


@pytestmark_real
def test_sigterm_to_the_owner_stops_every_process_of_its_cluster_store_nodes_too(tmp_path: Path) -> None:
    """The owner unwinds on SIGTERM (as the command line does): the cluster's exit stops it all."""
    script = textwrap.dedent(
        """
        import sys, time
        from kvpipe.connector.store.mooncake.cluster import LocalCluster
        from kvpipe.connector.store.mooncake.master import sigterm_unwinds
        with sigterm_unwinds(), LocalCluster(masters=2, store_nodes=1) as cluster:
            print(" ".join(map(str, cluster.pids)), flush=True)
            time.sleep(600)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        pids = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(pids) == 4 and all(psutil.pid_exists(pid) for pid in pids)  # etcd, 2 masters, a node
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if _alive(pid)] == []


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")
