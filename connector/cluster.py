"""A local Mooncake cluster for tests and demos: etcd and HA masters on free loopback ports.

Mooncake's HA masters (``--enable_ha``) elect a leader in etcd and keep their
operation log there (``--enable_oplog``), so a standby that takes over still has
every object. :class:`LocalCluster` starts Debian's ``etcd`` (``etcd-server``) and
``masters`` such masters on loopback, waits until one leads (a ~5 s warm-up), and
stops every process it started on exit, on an error while starting, and when the
process that owns it gets SIGTERM. Clients join it as ``etcd://127.0.0.1:PORT``
with ``P2PHANDSHAKE`` metadata.

Raises :class:`~.master.MasterError` (one line) when etcd or the masters cannot
start or no master leads in time.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Self

from .master import LOOPBACK, LocalMaster, MasterError, free_ports, stop_process, wait_until_listening
from .master_address import MasterAddress


def find_etcd() -> Path:
    found = shutil.which("etcd")
    if found is None:
        raise MasterError("etcd is not installed: install Debian's etcd-server (make test does)")
    return Path(found)


class LocalCluster:
    """etcd and ``masters`` HA masters on loopback. Use as a context manager."""

    def __init__(self, masters: int = 2, *, startup_timeout_s: float = 30.0) -> None:
        if masters < 1:
            raise ValueError(f"LocalCluster: masters must be >= 1, got {masters}")
        self._count = masters
        self._startup_timeout_s = startup_timeout_s
        self._etcd: subprocess.Popen[bytes] | None = None
        self._data_dir: Path | None = None
        self.etcd_port: int | None = None
        self.masters: list[LocalMaster] = []
        self._previous_sigterm: Any = None

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self.start()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through __exit__, which stops every process

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
        client_port, peer_port = free_ports(2)
        self.etcd_port = client_port
        self._data_dir = Path(tempfile.mkdtemp(prefix="kvpipe-etcd-"))
        client, peer = f"http://{LOOPBACK}:{client_port}", f"http://{LOOPBACK}:{peer_port}"
        self._etcd = subprocess.Popen(
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
            self.masters.append(LocalMaster(etcd_endpoints=f"{LOOPBACK}:{client_port}").start())
        self.wait_for_leader(self._startup_timeout_s)
        return self

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
        if self._etcd is not None and self._etcd.poll() is None:
            pids.append(self._etcd.pid)
        return pids

    def stop(self) -> None:
        for master in self.masters:
            master.stop()
        self.masters.clear()
        etcd, self._etcd = self._etcd, None
        if etcd is not None:
            stop_process(etcd)
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
