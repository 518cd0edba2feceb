"""A local Mooncake cluster for tests and demos: etcd, HA masters and store nodes on loopback.

Mooncake's HA masters (``--enable_ha``) elect a leader in etcd and keep their
operation log there (``--enable_oplog``), so a standby that takes over still has
every object. :class:`LocalCluster` starts Debian's ``etcd`` (``etcd-server``) and
``masters`` such masters on loopback, waits until one leads (a ~5 s warm-up), and
stops every process it started on exit and on an error while starting. It installs
no signal handler: an owner that must stop it on SIGTERM unwinds on SIGTERM
(:func:`~.master.sigterm_unwinds`, as the command line does). Clients join it as
``etcd://127.0.0.1:PORT`` with ``P2PHANDSHAKE`` metadata.

Store nodes (:class:`StoreNodeProcess`, each a ``kvpipe store`` process) hold the
objects: :meth:`LocalCluster.add_store_node` starts one (``store_nodes`` at start),
and a test kills one to see what a lost machine costs. Clients of such a cluster
mount no segment of their own (``global_segment_size: 0``). With ``node_disk``, each
node also mounts a disk tier of that size (:class:`~.settings.DiskTier`), in a folder
of its own under one the cluster creates and removes, and the masters offload.

Raises :class:`~.master.MasterError` (one line) when etcd or the masters cannot
start or no master leads in time.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from pydantic import TypeAdapter

from .master import (
    LOOPBACK,
    P2P_HANDSHAKE,
    LocalMaster,
    MasterError,
    free_ports,
    kill_process,
    spawn,
    stop_process,
    wait_until_listening,
)
from .master_address import MasterAddress
from .settings import DiskTier, PositiveSize


def find_etcd() -> Path:
    found = shutil.which("etcd")
    if found is None:
        raise MasterError("etcd is not installed: install Debian's etcd-server (make test does)")
    return Path(found)


class StoreNodeProcess:
    """One ``kvpipe store`` process: a segment of the cluster, until it is stopped or killed.

    Its JSON lines are read on a thread (a full pipe would block it): :attr:`segment_name`
    once it is ready, :attr:`last_use` as it reports. :attr:`disk` is its disk tier, if any.
    """

    def __init__(
        self,
        master_address: str,
        *,
        segment: str,
        metrics: list[str],
        startup_timeout_s: float = 30.0,
        local_hostname: str = LOOPBACK,
        launcher: Sequence[str] = (),
        disk: DiskTier | None = None,
    ) -> None:
        """``local_hostname``: its address as clients reach it; ``launcher``: what the command runs
        under (e.g. ``ip netns exec NS``: a node in a network namespace of its own); ``disk``: the
        disk tier behind its segment (the master must offload)."""
        disk_flags = [] if disk is None else [
            "--disk", str(disk.path), "--disk-size", str(disk.size),
            "--disk-read-buffer", str(disk.read_buffer),
        ]  # fmt: skip
        command = [
            *launcher,
            sys.executable, "-m", "kvpipe.connector.cli.main", "store",
            "--master", master_address, "--metadata-server", P2P_HANDSHAKE,
            "--segment", segment, "--json", "--report-every", "1",
            "--local-hostname", local_hostname,
            *(f"--master-metrics={endpoint}" for endpoint in metrics),
            *disk_flags,
        ]  # fmt: skip
        self._process = spawn(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        self.disk = disk
        self._ready = threading.Event()
        self._lines: deque[dict[str, object]] = deque(maxlen=100)
        self.segment_name = ""
        self.last_use: dict[str, object] | None = None
        threading.Thread(target=self._read, name="store-node-stdout", daemon=True).start()
        if not self._ready.wait(startup_timeout_s) or not self.segment_name:
            self.stop()
            raise MasterError(
                f"store node did not get ready within {startup_timeout_s:g} s "
                f"(exit code {self._process.poll()}): {list(self._lines)[-3:]}"
            )

    def _read(self) -> None:
        assert self._process.stdout is not None
        for raw in self._process.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            self._lines.append(line)
            if line.get("event") == "ready":
                self.segment_name = str(line["segment"])
                self._ready.set()
            elif line.get("event") == "segment":
                self.last_use = line
        self._ready.set()  # it exited: whoever waits learns it now, not at the deadline

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process.poll() is None else None

    def kill(self) -> None:
        """SIGKILL, as a lost machine: the master drops its objects after its client TTL."""
        kill_process(self._process)

    def terminate(self) -> None:
        """SIGTERM, not waiting: the node starts to unmount its segment and exit; :meth:`stop` waits.

        Nodes are slow to end (a client of an HA cluster closes only when its leader
        monitor's wait ends, up to 30 s), so several are told first and waited for after:
        they end side by side, not one after another.
        """
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)  # a stopped one cannot act on SIGTERM
            self._process.terminate()

    def stop(self) -> None:
        """SIGTERM: the node unmounts its segment and exits (SIGKILL after 15 s)."""
        stop_process(self._process, timeout_s=15.0)


class LocalCluster:
    """etcd, ``masters`` HA masters and ``store_nodes`` store nodes on loopback. Use as a context manager."""

    def __init__(
        self,
        masters: int = 2,
        *,
        store_nodes: int = 0,
        node_segment: str = "64MB",
        node_disk: str | None = None,
        enable_offload: bool = False,
        startup_timeout_s: float = 30.0,
    ) -> None:
        """``node_disk``: a size (``"1GB"``) gives every store node a disk tier that large;
        ``enable_offload``: the masters offload for clients with a disk tier (implied by
        ``node_disk``; :class:`~.master.LocalMaster`).

        :raises ValueError: ``masters`` < 1, ``store_nodes`` < 0, or a ``node_disk`` that is no size.
        """
        if masters < 1:
            raise ValueError(f"LocalCluster: masters must be >= 1, got {masters}")
        if store_nodes < 0:
            raise ValueError(f"LocalCluster: store_nodes must be >= 0, got {store_nodes}")
        self._count = masters
        self._node_count = store_nodes
        self._node_segment = node_segment
        self._node_disk = None if node_disk is None else TypeAdapter(PositiveSize).validate_python(node_disk)
        self._offload = enable_offload or node_disk is not None
        self._disks: Path | None = None  # the nodes' disk folders are in it
        self._disks_made = 0
        self.store_nodes: list[StoreNodeProcess] = []
        self._startup_timeout_s = startup_timeout_s
        self._etcd: subprocess.Popen[bytes] | None = None
        self._data_dir: Path | None = None
        self.etcd_port: int | None = None
        self.masters: list[LocalMaster] = []

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def master_address(self) -> str:
        """What clients pass as ``master_server_address``."""
        if self.etcd_port is None:
            raise MasterError("this cluster is not running")
        return f"etcd://{LOOPBACK}:{self.etcd_port}"

    @property
    def metadata_server(self) -> str:
        return self.masters[0].endpoints.metadata_server if self.masters and self.masters[0].endpoints else ""

    def start(self) -> Self:
        """Start etcd, the masters and the store nodes; return once a master leads.

        :raises MasterError: etcd or a master cannot start, no master leads within the start
            timeout, or a store node does not get ready; whatever started is stopped first.
        """
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Self:
        client_port, peer_port = free_ports(2)
        self.etcd_port = client_port
        self._data_dir = Path(tempfile.mkdtemp(prefix="kvpipe-etcd-"))
        client, peer = f"http://{LOOPBACK}:{client_port}", f"http://{LOOPBACK}:{peer_port}"
        self._etcd = spawn(
            [
                str(find_etcd()),
                "--data-dir", str(self._data_dir),
                "--listen-client-urls", client,
                "--advertise-client-urls", client,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"default={peer}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        wait_until_listening(LOOPBACK, client_port, timeout_s=self._startup_timeout_s, what="etcd")
        for _ in range(self._count):
            self.masters.append(
                LocalMaster(etcd_endpoints=f"{LOOPBACK}:{client_port}", enable_offload=self._offload).start()
            )
        self.wait_for_leader(self._startup_timeout_s)
        for _ in range(self._node_count):
            self.add_store_node()
        return self

    def add_store_node(self, segment: str | None = None) -> StoreNodeProcess:
        """A new ``kvpipe store`` process of ``segment`` bytes (the cluster's default size), ready."""
        metrics = [f"{m.endpoints.host}:{m.endpoints.metrics_port}" for m in self.masters if m.endpoints]
        node = StoreNodeProcess(
            self.master_address,
            segment=segment or self._node_segment,
            metrics=metrics,
            startup_timeout_s=self._startup_timeout_s,
            disk=self._new_disk(),
        )
        self.store_nodes.append(node)
        return node

    def _new_disk(self) -> DiskTier | None:
        """A disk tier in a folder no node used before: a node added after a kill must not bring back
        the lost node's objects (a lost machine loses its disk)."""
        if self._node_disk is None:
            return None
        if self._disks is None:
            self._disks = Path(tempfile.mkdtemp(prefix="kvpipe-disks-"))
        self._disks_made += 1
        return DiskTier(path=self._disks / f"node-{self._disks_made}", size=self._node_disk)

    def leader(self) -> LocalMaster | None:
        """The master etcd records as the leader, if it is one of ours and running."""
        led = MasterAddress.parse(self.master_address).leader(timeout_s=1.0)
        for master in self.masters:
            if (
                master.pid is not None
                and master.endpoints is not None
                and led
                == (
                    master.endpoints.host,
                    master.endpoints.rpc_port,
                )
            ):
                return master
        return None

    def wait_for_leader(self, timeout_s: float) -> LocalMaster:
        """The leading master once one serves; MasterError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        address = MasterAddress.parse(self.master_address)
        while True:
            leader = self.leader()
            if leader is not None and address.serving(timeout_s=0.5):
                return leader
            if time.monotonic() >= deadline:
                raise MasterError(
                    f"no mooncake master leads the cluster at {self.master_address} after {timeout_s:g} s"
                )
            time.sleep(0.1)

    @property
    def pids(self) -> list[int]:
        """Every process of the cluster that runs now."""
        pids = [master.pid for master in self.masters if master.pid is not None]
        pids += [node.pid for node in self.store_nodes if node.pid is not None]
        if self._etcd is not None and self._etcd.poll() is None:
            pids.append(self._etcd.pid)
        return pids

    def stop(self) -> None:
        for node in self.store_nodes:  # first: they unmount from a master that still runs
            node.terminate()
        for node in self.store_nodes:
            node.stop()
        self.store_nodes.clear()
        for master in self.masters:
            master.stop()
        self.masters.clear()
        etcd, self._etcd = self._etcd, None
        if etcd is not None:
            stop_process(etcd)
        for folder in (self._data_dir, self._disks):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self._data_dir = self._disks = None
