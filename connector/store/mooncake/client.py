"""The real store: Mooncake's ``MooncakeDistributedStore`` as a kvpipe :class:`~kvpipe.connector.store.protocol.Store`.

The client's own API already is the Store protocol, so :class:`MooncakeStore`
adds only what the raw client lacks and production needs:

- **A closed state.** Any call on a closed native client crashes the process
  (segfault), so the wrapper answers -900 itself after :meth:`MooncakeStore.close`,
  and close waits for calls in flight on other threads before closing.
- **Fast, one-line connection errors.** With no master listening, ``setup()``
  retries for ~90 s. :meth:`MooncakeStore.open` first checks that the master
  (and an HTTP metadata server) accept connections, within ``connect_timeout_s``;
  for an HA cluster (``etcd://``, ``redis://``: :mod:`.master_address`), that a
  leader serves.
- **A deadline on every master RPC.** A stopped master makes each call wait
  30 s before -901; ``rpc_timeout_ms`` (2 s by default) bounds that wait. The
  client reads it from ``MC_RPC_TIMEOUT_MS`` at set-up, so it is the process's:
  an explicit ``MC_RPC_TIMEOUT_MS`` in the environment wins.
- **A deadline on every transfer.** A store node cut off by the network (packets
  dropped, no connection refused) makes a get or a put to its segment wait 30 s
  before -800 (measured in network namespaces with the node's link down);
  ``transfer_timeout_s`` (3 s) bounds it. The transport reads
  ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (no progress that long: the connection is
  dropped) when it transfers, not at set-up, so opening a store sets it for the
  rest of the process (the last store opened wins; processes started later inherit
  it) unless the environment had one: then it is the user's and stays.
- **No 4.5 s calls while the master is gone.** A killed master makes the first
  call fail at once (-900), but every later one spends ~4.5 s in the client's
  reconnection attempts, whatever ``MC_RPC_TIMEOUT_MS`` says. So after a call
  whose every key came back -900, each call first checks that the master's port
  (in HA: the leader etcd records) accepts a connection (within ``rpc_timeout_ms``)
  and answers -900 itself when it does not; once it does, calls go to the client
  again, which reconnects (or follows the new leader).
- **A master for the asking.** ``master: spawn`` starts a ``mooncake_master`` on
  free loopback ports (:class:`~.master.LocalMaster`) and the store stops it on close;
  with ``cluster:`` beside it, a whole local cluster (:class:`~.cluster.LocalCluster`:
  etcd, HA masters, store nodes), stopped on close too.
- **A disk tier.** ``disk:`` (:class:`~.settings.DiskTier`) mounts a local-disk
  segment behind the memory one: the client is set up with Mooncake's SSD offload
  and the variables it reads that from, and a spawned master offloads.
- **vLLM's config file.** :meth:`MooncakeSettings.from_vllm_file` reads the JSON
  that vLLM's ``MooncakeStoreConnector`` users already have (``MOONCAKE_CONFIG_PATH``),
  with sizes parsed exactly as vLLM parses them.

``mooncake`` is imported only when a store opens: ``kvpipe.connector`` works
without the ``mooncake`` extra, and a missing wheel or system library becomes
one error that says what to install.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Self

from kvpipe.stages.store import EXISTS, Code, describe

from ..protocol import replicate_config_supports_group_ids
from .cluster import LocalCluster
from .master import (
    P2P_HANDSHAKE,
    LocalMaster,
    MasterEndpoints,
    MasterError,
    wait_until_listening,
)
from .master_address import MasterAddress
from .segment_liveness import SegmentLiveness
from .settings import DiskTier, MooncakeSettings, http_endpoint, mib_text

__all__ = ["MooncakeError", "MooncakeStore"]

log = logging.getLogger(__name__)

RPC_TIMEOUT_ENV = "MC_RPC_TIMEOUT_MS"
TRANSFER_TIMEOUT_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"
#: the deadlines the client reads from the environment at set-up; set by whoever started
#: the process, one is theirs, and settings leave it alone
_FROM_USER = {name for name in (RPC_TIMEOUT_ENV, TRANSFER_TIMEOUT_ENV) if name in os.environ}
#: setup()'s answer when this client mounts a disk and the master does not offload
UNABLE_OFFLOAD = -1300
INSTALL_HINT = "pip install 'kvpipe[mooncake]' (mooncake-transfer-engine-non-cuda==0.3.13.post1)"


class MooncakeError(RuntimeError):
    """The Mooncake client cannot be loaded or set up."""


def _import_mooncake() -> tuple[type, type]:
    """``(MooncakeDistributedStore, ReplicateConfig)``, or one error saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        if "libibverbs" in str(exc):
            hint = "install the system library: apt-get install -y libibverbs1 (needed even for TCP)"
        else:
            hint = INSTALL_HINT
        raise MooncakeError(f"the Mooncake client cannot be loaded ({exc}); {hint}") from exc
    return MooncakeDistributedStore, ReplicateConfig


def _soft_pin_enable(config_cls: type) -> Any:
    """``SoftPinAction.ENABLE`` where this Mooncake's replicate config takes soft pins, else None.

    Releases before 0.3.13 have no ``soft_pin_action``: puts there are never pinned
    (said once, at open), which is retention off, not an error.
    """
    try:
        from mooncake.store import SoftPinAction
    except ImportError:
        SoftPinAction = None  # noqa: N806 - the binding's class name
    if SoftPinAction is None or not hasattr(config_cls(), "soft_pin_action"):
        log.warning("this Mooncake has no soft pins: retention stores nothing pinned")
        return None
    return SoftPinAction.ENABLE


_SETUP_HINTS = {
    Code.INVALID_PARAMS: "invalid parameters (a global segment under 16 MiB, or an unknown protocol or device)",
    UNABLE_OFFLOAD: "the master does not offload to disk: a client with a disk tier needs a master "
    "started with --enable_offload=true",
}


class MooncakeStore:
    """A set-up Mooncake client as a :class:`~kvpipe.connector.store.protocol.Store`; open with :meth:`open`.

    Thread-safe the way the native client is (calls may overlap), plus a closed
    state: after :meth:`close` every call returns -900 and the native client is
    never touched again. Close it (or use ``with``) to unmount its segment and
    stop a master it spawned; an unclosed store is closed at interpreter exit.
    """

    def __init__(
        self,
        client: Any,
        config_cls: type,
        *,
        settings: MooncakeSettings,
        master_address: str,
        metadata_server: str,
        master: LocalMaster | LocalCluster | None = None,
        drain_timeout_s: float = 60.0,
    ) -> None:
        self._client = client
        self._config_cls = config_cls
        self._supports_group_ids = replicate_config_supports_group_ids(config_cls, config_cls())
        self._pin_enable = _soft_pin_enable(config_cls)
        self.settings = settings
        self.master_address = master_address
        self.metadata_server = metadata_server
        self._master = master
        self._drain_timeout_s = drain_timeout_s
        self._state = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self._users = 1  # open_shared hands the same store out again; close ends it for the last user
        self._shared_as: MooncakeSettings | None = None  # its key in open_shared's registry
        # set when a call found the master gone (every key -900): see _master_back
        self._master_lost = False
        self._address = MasterAddress.parse(master_address)
        self.rpc_timeout_s = _rpc_timeout_ms(settings) / 1000  # the deadline the client really has
        self._liveness = SegmentLiveness(probe_timeout_s=min(0.2, self.rpc_timeout_s))
        # the client in a list the finalizer empties: ending the native object is part of a release
        self._release = weakref.finalize(self, _release, [client], master)

    @classmethod
    def open(cls, settings: MooncakeSettings | None = None) -> MooncakeStore:
        """Connect (spawning a master if asked), set the client up, and return the store.

        :raises MasterError: the master or metadata server cannot be started or
            reached within ``connect_timeout_s``; a second etcd cluster in this process.
        :raises MooncakeError: the client cannot be loaded or ``setup()`` fails (naming its code).
        """
        settings = settings or MooncakeSettings()
        client_cls, config_cls = _import_mooncake()
        master: LocalMaster | LocalCluster | None = None
        if settings.master == "spawn" and settings.cluster is not None:
            spec = settings.cluster
            master = LocalCluster(
                spec.masters,
                store_nodes=spec.store_nodes,
                node_segment=str(spec.node_segment),
                node_disk=None if spec.node_disk is None else str(spec.node_disk),
                enable_offload=settings.disk is not None,
            )
            master.__enter__()  # its SIGTERM handler too: the store's owner stops it all on SIGTERM
            master_address = master.master_address
            metadata_server = settings.metadata_server or P2P_HANDSHAKE
        elif settings.master == "spawn":
            master = LocalMaster(
                lease_ttl_ms=settings.lease_ttl_ms,
                eviction_high_watermark=settings.eviction_high_watermark,
                eviction_ratio=settings.eviction_ratio,
                client_ttl_s=settings.client_ttl_s,
                enable_offload=settings.disk is not None,
            ).start()
            assert master.endpoints is not None
            master_address = master.endpoints.master_address
            metadata_server = settings.metadata_server or master.endpoints.metadata_server
        else:
            master_address = settings.master
            assert settings.metadata_server is not None  # validated
            metadata_server = settings.metadata_server
        try:
            _check_reachable(master_address, metadata_server, settings.connect_timeout_s)
            etcd = _one_etcd_per_process(master_address)
            client = client_cls()
            extra: dict[str, Any] = {}
            if settings.tenant_id != "default":
                extra["tenant_id"] = settings.tenant_id
            if settings.disk is not None:
                extra.update(enable_ssd_offload=True, ssd_offload_path=_disk_folder(settings.disk))
            disk_environment = settings.disk.mooncake_environment() if settings.disk is not None else {}
            with _deadlines_for_setup(settings), _set_for_setup(disk_environment):
                code = client.setup(
                    settings.local_hostname,
                    metadata_server,
                    settings.global_segment_size,
                    settings.local_buffer_size,
                    settings.protocol,
                    settings.device_name,
                    master_address,
                    **extra,
                )
            if code != 0:
                # A failed set-up may leave the segment mounted (-1300 does): the destructor
                # unmounts it here, while the master serves, not when the error is collected.
                client.close()
                del client
                hint = _SETUP_HINTS.get(code, "see the client's log above")
                raise MooncakeError(
                    f"Mooncake setup() failed with {describe(code)} for master {master_address}, "
                    f"metadata {metadata_server}, protocol {settings.protocol!r}, "
                    f"segment {mib_text(settings.global_segment_size)}: {hint}"
                )
            if etcd is not None:
                _JOINED_ETCD.append(etcd)
        except BaseException:
            if master is not None:
                _stop_spawned(master)
            raise
        return cls(
            client,
            config_cls,
            settings=settings,
            master_address=master_address,
            metadata_server=metadata_server,
            master=master,
        )

    @classmethod
    def open_shared(cls, settings: MooncakeSettings) -> MooncakeStore:
        """The process's client for ``settings``: opened once, closed when its last user closes it.

        Mooncake's client is made to be one per process (one etcd connection, one
        transfer engine): two clients of one HA cluster in a process do not follow a
        new leader alike (measured: one back 14 s after a leader's kill, the other
        33 s), so a vLLM engine's scheduler and worker share one. ``master: spawn``
        is never shared: each asker gets a master of its own.

        Raises what :meth:`open` raises.
        """
        if settings.master == "spawn":
            return cls.open(settings)
        key = MooncakeSettings.model_validate(settings.model_dump(include=set(MooncakeSettings.model_fields)))
        with _SHARED_LOCK:
            store = _SHARED.get(key)
            if store is not None:
                with store._state:
                    if not store._closed:
                        store._users += 1
                        return store
            store = cls.open(settings)
            store._shared_as = key
            _SHARED[key] = store
            return store

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        spawned = " (spawned)" if self._master is not None else ""
        state = "closed" if self._closed else "open"
        return (
            f"MooncakeStore(master={self.master_address}{spawned}, metadata={self.metadata_server}, "
            f"segment={mib_text(self.settings.global_segment_size)}, {state})"
        )

    # -- for reports ------------------------------------------------------------------------

    @property
    def endpoints(self) -> MasterEndpoints | None:
        """The spawned master's ports; None when the master is someone else's."""
        return self.spawned_master.endpoints if self.spawned_master is not None else None

    @property
    def spawned_master(self) -> LocalMaster | None:
        """The one master this store spawned (``master: spawn`` without ``cluster``)."""
        return self._master if isinstance(self._master, LocalMaster) else None

    @property
    def spawned_cluster(self) -> LocalCluster | None:
        """The local cluster this store spawned (``master: spawn`` with ``cluster``)."""
        return self._master if isinstance(self._master, LocalCluster) else None

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the Store protocol -----------------------------------------------------------------

    @property
    def supports_group_ids(self) -> bool:
        return self._supports_group_ids

    @property
    def local_transfers(self) -> bool:
        # A client that mounts a segment is taken to be a store of one host: the
        # master places its puts there and the transfer engine copies with memcpy.
        # Without one (vLLM's standalone-store mode) every put goes to a peer.
        return self.settings.global_segment_size > 0 and self.settings.protocol == "tcp"

    def hostname(self) -> str:
        """This client's name in the store: its segment's name, as the master's metrics label it."""
        with self._state:
            if self._closed:
                raise MooncakeError("this Mooncake store is closed")
            return str(self._client.get_hostname())

    def new_replicate_config(self, *, soft_pin_ttl_ms: int | None = None) -> Any:
        config = self._config_cls()
        config.replica_num = self.settings.replicas
        if soft_pin_ttl_ms is not None and self._pin_enable is not None:
            config.soft_pin_action = self._pin_enable
            config.soft_pin_ttl_ms = soft_pin_ttl_ms
        return config

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """The master's answers, less objects with a replica on a node that does not answer.

        The master counts a dead node's objects for its client TTL (10 s) after the
        node died, and every read of them fails: :mod:`.segment_liveness` tells
        them apart (``verify_replicas``), at the cost of one more RPC when any key exists.
        A read may go to any of an object's replicas, and one that goes to a node cut
        off by the network (packets dropped, not refused) waits for the kernel to give
        up its connection, tens of seconds (measured: ~33 s): so an object is present
        only when every replica it may be read from is on a node that answers.
        """
        answers = self._master_call(len(keys), lambda c: c.batch_is_exist(list(keys)))
        if not self.settings.verify_replicas or 1 not in answers:
            return answers
        present = [key for key, answer in zip(keys, answers, strict=True) if answer == EXISTS]
        lost = self._on_lost_nodes(present)
        return [
            0 if answer == EXISTS and key in lost else answer
            for key, answer in zip(keys, answers, strict=True)
        ]

    def _on_lost_nodes(self, keys: list[str]) -> set[str]:
        """Those of ``keys`` with a replica on a node that does not accept connections (none if unknown)."""
        if not self._enter():
            return set()
        try:
            replicas = self._client.batch_get_replica_desc(keys)
        except Exception:  # a descriptor this wheel cannot give: keep the master's word
            log.debug("mooncake: batch_get_replica_desc failed; replicas not verified", exc_info=True)
            return set()
        finally:
            self._leave()
        from mooncake.store import ReplicaStatus

        complete = ReplicaStatus.COMPLETE
        alive: dict[str, bool] = {}  # per endpoint, for this call: most keys share their nodes

        def on_live_nodes(key: str) -> bool:
            for endpoint in _endpoints(replicas.get(key, ()), complete):
                answer = alive.get(endpoint)
                if answer is None:
                    answer = alive[endpoint] = self._liveness.alive(endpoint)
                if not answer:
                    return False
            return True

        return {key for key in keys if not on_live_nodes(key)}

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        config: Any,
    ) -> list[int]:
        return self._master_call(
            len(keys), lambda c: c.batch_put_from_multi_buffers(list(keys), ptrs, sizes, config)
        )

    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
    ) -> list[int]:
        return self._master_call(len(keys), lambda c: c.batch_get_into_multi_buffers(list(keys), ptrs, sizes))

    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], config: Any
    ) -> list[int]:
        return self._master_call(len(keys), lambda c: c.batch_put_from(list(keys), ptrs, sizes, config))

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return self._master_call(len(keys), lambda c: c.batch_get_into(list(keys), ptrs, sizes))

    def get_size(self, key: str) -> int:
        return self._master_call(1, lambda c: [c.get_size(key)])[0]

    def remove(self, key: str, *, force: bool = False) -> int:
        return self._master_call(1, lambda c: [c.remove(key, force)])[0]

    def remove_all(self, *, force: bool = False) -> int:
        """As the protocol says; ``force`` also removes leased objects (cleanup only)."""
        return self._master_call(1, lambda c: [c.remove_all(force)])[0]

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return self._master_call(1, lambda c: [c.remove_by_regex(pattern, force)])[0]

    def register_buffer(self, addr: int, nbytes: int) -> int:
        return self._one(lambda c: c.register_buffer(addr, nbytes))

    def unregister_buffer(self, addr: int) -> int:
        return self._one(lambda c: c.unregister_buffer(addr))

    def close(self) -> None:
        """Unmount and release the client, then stop a spawned master. Idempotent.

        Calls in flight on other threads finish first (closing under them would
        crash the process). If they outlast ``drain_timeout_s`` the native
        client is left open, which leaks it but keeps the process alive.
        """
        with self._state:
            if self._closed:
                return
            if self._users > 1:  # another user of open_shared still has it
                self._users -= 1
                return
            self._closed = True
            if self._shared_as is not None and _SHARED.get(self._shared_as) is self:
                del _SHARED[self._shared_as]
            drained = self._state.wait_for(lambda: self._in_flight == 0, timeout=self._drain_timeout_s)
        if drained:
            self._client = None  # the finalizer's is then the last reference: _release ends the client
            self._release()
            return
        log.warning(
            "mooncake: %d calls still in flight after %g s; leaving the client open",
            self._in_flight,
            self._drain_timeout_s,
        )
        self._release.detach()
        if self._master is not None:
            _stop_spawned(self._master)

    # -- internals --------------------------------------------------------------------------

    def _master_call(self, n_keys: int, call: Callable[[Any], list[int]]) -> list[int]:
        """A call that needs the master: -900 at once while it is known gone and not back."""
        if self._master_lost and not self._master_back():
            return [Code.RPC_FAILED] * n_keys
        results = self._batch(n_keys, call)
        if results:
            self._master_lost = all(code == Code.RPC_FAILED for code in results) and not self._closed
        return results

    def _master_back(self) -> bool:
        """Whether a master serves again: its port, or in HA the recorded leader's (bounded by the RPC deadline).

        The client's own call would find out only after ~4.5 s of reconnection
        attempts; a connection refused on the port says the same at once.
        """
        return self._address.serving(self.rpc_timeout_s)

    def _batch(self, n_keys: int, call: Callable[[Any], list[int]]) -> list[int]:
        if not self._enter():
            return [Code.RPC_FAILED] * n_keys
        try:
            return call(self._client)
        finally:
            self._leave()

    def _one(self, call: Callable[[Any], int]) -> int:
        if not self._enter():
            return Code.RPC_FAILED
        try:
            return call(self._client)
        finally:
            self._leave()

    def _enter(self) -> bool:
        with self._state:
            if self._closed:
                return False
            self._in_flight += 1
            return True

    def _leave(self) -> None:
        with self._state:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._state.notify_all()


@contextmanager
def _deadlines_for_setup(settings: MooncakeSettings) -> Iterator[None]:
    """``MC_RPC_TIMEOUT_MS`` as ``setup()`` must read it, then as it was; ``MC_TCP_PROGRESS_TIMEOUT_SEC`` for good.

    The RPC deadline left set would outlive this store: processes started later (an
    engine's workers) inherit the environment and would take it for the user's.
    The transfer deadline is read at each transfer, so it must stay.
    """
    if TRANSFER_TIMEOUT_ENV not in _FROM_USER:
        os.environ[TRANSFER_TIMEOUT_ENV] = str(settings.transfer_timeout_s)
    if RPC_TIMEOUT_ENV in _FROM_USER:
        yield
        return
    previous = os.environ.get(RPC_TIMEOUT_ENV)
    os.environ[RPC_TIMEOUT_ENV] = str(settings.rpc_timeout_ms)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RPC_TIMEOUT_ENV, None)
        else:
            os.environ[RPC_TIMEOUT_ENV] = previous


def _disk_folder(disk: DiskTier) -> str:
    """The disk tier's folder, created if missing (Mooncake's client refuses a missing one).

    :raises MooncakeError: it cannot be created (naming the folder and why).
    """
    try:
        disk.path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MooncakeError(f"disk.path: cannot create {disk.path}: {exc.strerror or exc}") from None
    return str(disk.path)


@contextmanager
def _set_for_setup(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in the environment while ``setup()`` reads them, then the environment as it was.

    Mooncake's client reads its disk tier's configuration from the environment, once,
    in ``setup()``, and from no other source; so it is set in this process, around the
    call. Left set, it would pass to every process started later (an engine's workers)
    and override what their users set; a value the user exported is set aside during
    the call only (the disk settings decide the tier).
    """
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _rpc_timeout_ms(settings: MooncakeSettings) -> int:
    """The RPC deadline the client was set up with: the user's ``MC_RPC_TIMEOUT_MS`` or ours."""
    if RPC_TIMEOUT_ENV in _FROM_USER:
        try:
            return max(1, int(os.environ[RPC_TIMEOUT_ENV]))
        except (KeyError, ValueError):
            pass
    return settings.rpc_timeout_ms


#: the clients open_shared hands out, by their settings (a closed one is replaced)
_SHARED: dict[MooncakeSettings, MooncakeStore] = {}
_SHARED_LOCK = threading.Lock()

#: the etcd endpoints this process's Mooncake clients joined: the library keeps one etcd
#: client per process and refuses another ("Etcd client already connected to ...")
_JOINED_ETCD: list[tuple[tuple[str, int], ...]] = []


def _one_etcd_per_process(master_address: str) -> tuple[tuple[str, int], ...] | None:
    """The etcd endpoints of ``master_address`` (None if it is no etcd cluster); MasterError for a second etcd."""
    address = MasterAddress.parse(master_address)
    if address.kind != "etcd":
        return None
    if _JOINED_ETCD and _JOINED_ETCD[0] != address.endpoints:
        joined = ";".join(f"{host}:{port}" for host, port in _JOINED_ETCD[0])
        raise MasterError(
            f"this process joined the mooncake cluster at etcd://{joined} already: Mooncake's client keeps one "
            f"etcd connection per process, so etcd://{';'.join(f'{h}:{p}' for h, p in address.endpoints)} "
            "needs a process of its own"
        )
    return address.endpoints


def _check_reachable(master_address: str, metadata_server: str, timeout_s: float) -> None:
    """MasterError within ``timeout_s`` unless a master serves (and an HTTP metadata server listens).

    In HA, a leader must be recorded and listening: a cluster whose masters are
    all standing by (or gone) would make ``setup()`` retry for ~90 s.
    """
    address = MasterAddress.parse(master_address)
    if address.kind == "direct":
        wait_until_listening(*address.endpoints[0], timeout_s=timeout_s, what="mooncake master")
    else:
        deadline = time.monotonic() + timeout_s
        while not address.serving(timeout_s=min(0.5, timeout_s)):
            if time.monotonic() >= deadline:
                what = (
                    "no etcd endpoint listens"
                    if not address.coordinators_listening(0.5)
                    else "no master leads"
                )
                raise MasterError(
                    f"mooncake cluster at {master_address} is not reachable: {what} (waited {timeout_s:g} s)"
                )
            time.sleep(0.05)
    if (http := http_endpoint(metadata_server)) is not None:
        wait_until_listening(*http, timeout_s=timeout_s, what="mooncake metadata server")


def _endpoints(replicas: Sequence[Any], complete: Any) -> Iterator[str]:
    """The transfer endpoints of an object's replicas in state ``complete``; ``""`` for one not in memory.

    (``""`` is no ``host:port``, so it counts as alive: a disk replica is not probed.)
    The state is compared as the enum it is: its ``str`` costs ~3.6 µs, most of a
    lookup's verification (800 stored keys: its Python 5.0 -> ~2 ms).
    """
    for replica in replicas:
        if replica.status != complete:
            continue
        yield (
            replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
            if replica.is_memory_replica()
            else ""
        )


def _stop_spawned(spawned: LocalMaster | LocalCluster) -> None:
    if isinstance(spawned, LocalCluster):
        spawned.__exit__(None, None, None)  # restores the SIGTERM handler it installed
    else:
        spawned.stop()


def _release(native: list[Any], master: LocalMaster | LocalCluster | None) -> None:
    """Close and end the client, then stop the master (or cluster) it was mounted on (the unmount needs it).

    ``native`` holds the last reference to the client. With a disk tier, its ``close()``
    returns before it has unmounted: the native object's destructor does that, once its
    disk threads stop (about a heartbeat, a second here), so the object must be gone
    before its master is; against a stopped master the unmount retries for ~20 s.
    """
    try:
        client = native.pop()
        client.close()
        del client  # the destructor runs here, while the master still serves
    finally:
        if master is not None:
            _stop_spawned(master)
