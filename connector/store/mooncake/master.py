"""A local ``mooncake_master`` on free loopback ports, for tests, demos and ``master: spawn``.

Mooncake's Python wheel is client-only: the master is a separate program
(``mooncake_master``, installed beside the interpreter). :class:`LocalMaster`
starts one bound to 127.0.0.1 on ports picked free at start (the admin/metrics
port too: its default, 9003, clashes between masters), waits until it accepts
connections, and stops it on exit. Only loopback: a spawned master is never
reachable from another machine. That is also why it runs no HTTP metadata
server: that server binds 0.0.0.0 whatever host it is given, so clients of a
spawned master exchange their segment metadata peer to peer (``P2PHANDSHAKE``).

:func:`wait_until_listening` is also how a configured master is checked before
``setup()``: with no master listening, the client's setup retries for ~90 s before
failing, and a serving engineer deserves a one-line error in seconds instead.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, Self

from kvpipe.connector import exit_guard

from .listening import is_listening
from .master_address import cluster_id as joined_cluster

LOOPBACK = "127.0.0.1"
P2P_HANDSHAKE = "P2PHANDSHAKE"


class MasterError(RuntimeError):
    """The master could not be found, started or reached."""


@dataclass(frozen=True)
class MasterEndpoints:
    host: str
    rpc_port: int
    metrics_port: int

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """What clients of this master pass as their metadata server (see the module docstring)."""
        return P2P_HANDSHAKE


#: the kernel's range for ports it picks itself (a bind to port 0, an outgoing connection's own port)
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: handed-out ports start above those Mooncake's client and transfer engine pick at random for
#: themselves (12,300-17,000 in our logs)
HANDOUT_FLOOR = 20000
_HANDOUT_ATTEMPTS = 1000
#: the OS's randomness: a seeded global generator would make two processes pick alike
_PICKER = random.SystemRandom()


def handout_range() -> range:
    """Where :func:`free_ports` picks: from :data:`HANDOUT_FLOOR` up to the kernel's ephemeral range.

    Empty when the ephemeral range starts below the floor (a host configured so):
    then no port is out of the kernel's reach, and the kernel picks.
    """
    try:
        low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return range(HANDOUT_FLOOR, max(HANDOUT_FLOOR, low))


def free_port(host: str = LOOPBACK) -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports nothing is bound to now, for processes that bind them later.

    Picked below the kernel's ephemeral range (:func:`handout_range`), so that no port
    the kernel picks (anyone's bind to port 0, any outgoing connection) can take one
    before its process binds it. That can be minutes later: a standby master binds its
    RPC port only once it is promoted, and a port taken meanwhile (seen once in CI)
    made the promoted standby fail and drop its lease, so no master led again. Ports
    are held together while picked, so they are distinct.

    :raises MasterError: no free port found in :data:`_HANDOUT_ATTEMPTS` tries.
    """
    span = handout_range()
    probes: list[socket.socket] = []
    try:
        for _ in range(_HANDOUT_ATTEMPTS if span else count):
            if len(probes) == count:
                break
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                probe.bind((host, _PICKER.choice(span) if span else 0))
            except OSError:
                probe.close()
                continue
            probes.append(probe)
        if len(probes) < count:
            raise MasterError(f"no {count} free ports on {host} in {span} after {_HANDOUT_ATTEMPTS} tries")
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def wait_until_listening(host: str, port: int, timeout_s: float, what: str = "mooncake master") -> None:
    """Return once ``host:port`` accepts a connection; MasterError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not is_listening(host, port):
        if time.monotonic() >= deadline:
            raise MasterError(f"{what} at {host}:{port} is not reachable (waited {timeout_s:g} s)")
        time.sleep(0.05)


def spawn(command: Sequence[str], **options: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(command, **options)``, stopped when this interpreter exits unless stopped before.

    An owner that never stops its master, etcd or store node (a script without
    ``with``, an error between a start and its stop) would otherwise leave it
    running after the owner exits, holding its ports and its memory
    (:mod:`kvpipe.connector.exit_guard`; a SIGTERM'd command line unwinds first:
    :func:`sigterm_unwinds`).
    """
    process: subprocess.Popen[bytes] = subprocess.Popen(command, **options)
    exit_guard.guard(process, lambda: stop_process(process))
    return process


def kill_process(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL, as a crash would, and reap it."""
    exit_guard.release(process)
    process.kill()
    process.wait()


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """End a child: SIGCONT (a stopped one cannot act on SIGTERM), SIGTERM, SIGKILL after ``timeout_s``."""
    exit_guard.release(process)
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGCONT)
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within it, SIGTERM (what ``timeout``, ``kill`` and service managers send) unwinds as Ctrl-C does.

    Python's default for SIGTERM is to die on the spot, leaving the masters,
    clusters and engine processes a process started running; raised as
    ``SystemExit(143)`` instead, it unwinds through their context managers, which
    stop them. Off the main thread (where no handler can be installed) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    raise SystemExit(128 + signum)


def find_master_binary() -> Path:
    """``mooncake_master`` beside this interpreter (a venv's bin) or on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.exists():
        return beside
    found = shutil.which("mooncake_master")
    if found is None:
        raise MasterError(
            "mooncake_master not found beside the interpreter or on PATH; "
            "install mooncake-transfer-engine-non-cuda (the 'mooncake' extra)"
        )
    return Path(found)


class LocalMaster:
    """A ``mooncake_master`` child process on loopback. Use as a context manager."""

    def __init__(
        self,
        *,
        lease_ttl_ms: int | None = None,
        eviction_high_watermark: float | None = None,
        eviction_ratio: float | None = None,
        client_ttl_s: int | None = None,
        put_discard_s: int | None = None,
        enable_offload: bool = False,
        etcd_endpoints: str | None = None,
        cluster_id: str | None = None,
        snapshot_dir: Path | None = None,
        snapshot_interval_s: int = 2,
        startup_timeout_s: float = 20.0,
    ) -> None:
        """``etcd_endpoints`` (``host:port;...``) makes it one of an HA group that elects a leader
        there, with its operation log in etcd (without it a standby takes over with an empty store);
        ``cluster_id`` names the cluster it leads there; by default the one this process's
        clients join (``MC_STORE_CLUSTER_ID``, else Mooncake's ``mooncake_cluster``).

        ``snapshot_dir`` makes it snapshot its metadata there every ``snapshot_interval_s``
        and restore the latest snapshot when it starts (Mooncake reads the folder from
        ``MOONCAKE_SNAPSHOT_LOCAL_PATH``), so a restart keeps what the last snapshot held;
        objects whose lease ran out are dropped on restore.

        ``put_discard_s``: how long an object reserved for a ranged put (a layer-wise save)
        waits for its writer to end it before the master drops it (``--put_start_discard_timeout_sec``,
        Mooncake's default 30 s): a writer that died leaves its reservation that long.

        ``enable_offload`` lets clients mount a disk tier (:class:`~.settings.DiskTier`;
        without it their ``setup()`` fails with -1300) and has them write an object
        there when it evicts the object from their memory segment, rather than at every
        put (``--offload_on_evict``): disk writes are then the evictions, not every put.
        """
        self._flags: dict[str, str] = {}
        self.ha = etcd_endpoints is not None
        if etcd_endpoints is not None:
            self._flags.update(enable_ha="true", enable_oplog="true", etcd_endpoints=etcd_endpoints)
            if cluster_id is None:
                cluster_id = joined_cluster()
        if cluster_id is not None:
            self._flags["cluster_id"] = cluster_id
        if lease_ttl_ms is not None:
            self._flags["default_kv_lease_ttl"] = str(lease_ttl_ms)
        if eviction_high_watermark is not None:
            self._flags["eviction_high_watermark_ratio"] = str(eviction_high_watermark)
        if eviction_ratio is not None:
            self._flags["eviction_ratio"] = str(eviction_ratio)
        if client_ttl_s is not None:
            self._flags["client_ttl"] = str(client_ttl_s)
        if put_discard_s is not None:
            self._flags["put_start_discard_timeout_sec"] = str(put_discard_s)
        if enable_offload:
            self._flags.update(enable_offload="true", offload_on_evict="true")
        self._env: dict[str, str] | None = None
        if snapshot_dir is not None:
            self._flags.update(
                enable_snapshot="true",
                enable_snapshot_restore="true",
                snapshot_interval_seconds=str(snapshot_interval_s),
                snapshot_object_store_type="local",
            )
            self._env = {**os.environ, "MOONCAKE_SNAPSHOT_LOCAL_PATH": str(snapshot_dir)}
        self._startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = None
        self.endpoints: MasterEndpoints | None = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self, endpoints: MasterEndpoints | None = None) -> Self:
        """Start on ``endpoints`` (e.g. the ports of a master that died) or on free ports.

        A free port can be taken by someone else (an outgoing connection, another
        master) before the master binds it; on free ports that clash is retried
        with new ones.

        :raises MasterError: this master is running already; ``mooncake_master`` is not
            installed; it exits (the message quotes its log) or does not listen within
            its start timeout.
        """
        if self._process is not None:
            raise MasterError("this master is already running")
        attempts = 1 if endpoints is not None else 3
        for attempt in range(1, attempts + 1):
            self.endpoints = endpoints or MasterEndpoints(LOOPBACK, *free_ports(2))
            try:
                return self._launch()
            except MasterError as exc:
                if attempt == attempts or "address already in use" not in str(exc).lower():
                    raise
        raise AssertionError("unreachable")

    def _launch(self) -> Self:
        assert self.endpoints is not None
        e = self.endpoints
        command = [
            str(find_master_binary()),
            f"--rpc_port={e.rpc_port}",
            f"--rpc_address={e.host}",
            "--enable_http_metadata_server=false",
            f"--metrics_port={e.metrics_port}",
            f"--metrics_host={e.host}",
            *(f"--{name}={value}" for name, value in self._flags.items()),
        ]
        fd, log_name = tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")
        self._log_path = Path(log_name)
        with os.fdopen(fd, "wb") as log:
            self._process = spawn(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._master_env(),
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _master_env(self) -> dict[str, str]:
        """The master's environment: ours, with its log at every level whatever ours quiets.

        Start-up reads the log (a port taken meanwhile is retried on new ports only if the
        log says so), and a ``GLOG_minloglevel`` set to quiet a client would empty it.
        """
        env = dict(os.environ if self._env is None else self._env)
        env.pop("GLOG_minloglevel", None)
        return env

    def _wait_ready(self) -> None:
        """Until it listens; an HA master listens only once it leads, so for it: until it runs."""
        assert self._process is not None and self.endpoints is not None
        deadline = time.monotonic() + self._startup_timeout_s
        port = self.endpoints.rpc_port
        if self.ha:
            deadline = time.monotonic() + 0.3  # started and still running: it stands by or leads
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise MasterError(
                        f"mooncake_master exited with {self._process.returncode}: {self.log_tail()}"
                    )
                time.sleep(0.05)
            return
        while not is_listening(self.endpoints.host, port, timeout_s=0.2):
            if self._process.poll() is not None:
                raise MasterError(
                    f"mooncake_master exited with {self._process.returncode}: {self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise MasterError(
                    f"mooncake_master did not listen on port {port} within {self._startup_timeout_s:g} s"
                )
            time.sleep(0.05)

    def log_tail(self, lines: int = 5) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return " | ".join(self._log_path.read_text(errors="replace").strip().splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL, as a crash would; its keys are gone with it."""
        if self._process is not None:
            kill_process(self._process)
            self._process = None

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            stop_process(process)
        if self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
            self._log_path = None
