"""The real store: Mooncake's ``MooncakeDistributedStore`` as a kvpipe :class:`~kvpipe.connector.store.protocol.Store`.

The client's own API already is the Store protocol, so :class:`MooncakeStore`
adds only what the raw client lacks and production needs:

- **A closed state.** Any call on a closed native client crashes the process
  (segfault), so the wrapper answers -900 itself after :meth:`MooncakeStore.close`,
  and close waits for calls in flight on other threads before closing.
- **Fast, one-line connection errors.** With no master listening, ``setup()``
  retries for ~90 s. :meth:`MooncakeStore.open` first checks that a master serves
  (:mod:`.reachability`), within ``connect_timeout_s``.
- **A deadline on every master RPC.** A stopped master makes each call wait
  30 s before -901; ``rpc_timeout_ms`` (2 s by default) bounds that wait
  (``MC_RPC_TIMEOUT_MS``, read at set-up: :mod:`.environment`; the user's wins).
- **A deadline on every transfer.** A store node cut off by the network (packets
  dropped, no connection refused) makes a get or a put to its segment wait 30 s
  before -800 (measured in network namespaces with the node's link down);
  ``transfer_timeout_s`` (3 s) bounds it (``MC_TCP_PROGRESS_TIMEOUT_SEC``, read at
  each transfer, so left set for the rest of the process: :mod:`.environment`).
- **No 4.5 s calls while the master is gone.** A killed master makes the first
  call fail at once (-900), but every later one spends ~4.5 s in the client's
  reconnection attempts, whatever ``MC_RPC_TIMEOUT_MS`` says. So after a call
  whose every key came back -900, each call first checks that the master's port
  (in HA: the leader etcd records) accepts a connection (within ``rpc_timeout_ms``)
  and answers -900 itself when it does not; once it does, calls go to the client
  again, which reconnects (or follows the new leader).
- **A master for the asking.** ``master: spawn`` starts a master or a whole local
  cluster (:mod:`.master_resolution`), and the store stops it on close.
- **One client per settings, one etcd cluster per process.** :meth:`MooncakeStore.open_shared`
  and the etcd check share the process's state (:mod:`.registry`).
- **Objects on lost nodes are not counted.** :meth:`MooncakeStore.batch_is_exist` drops
  objects with a replica on a store node that does not answer (:mod:`.segment_liveness`).
- **A disk tier.** ``disk:`` (:class:`~.settings.DiskTier`) mounts a local-disk
  segment behind the memory one: the client is set up with Mooncake's SSD offload
  and the variables it reads that from (:mod:`.environment`), and a spawned master
  offloads.
- **The store's capacity.** Mooncake's client API has no call that lists segments or
  capacity, so :meth:`MooncakeStore.capacity_bytes` reads the master's admin HTTP
  (:mod:`.admin`), where its address is known: ``master_metrics``, or a spawned master's.
- **vLLM's config file.** :meth:`MooncakeSettings.from_vllm_file` reads the JSON
  that vLLM's ``MooncakeStoreConnector`` users already have (``MOONCAKE_CONFIG_PATH``),
  with sizes parsed exactly as vLLM parses them.

``mooncake`` is imported only when a store opens: ``kvpipe.connector`` works
without the ``mooncake`` extra, and a missing wheel or system library becomes
one error that says what to install.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, Self

from kvpipe.stages.store import EXISTS, Code, describe

from ..protocol import replicate_config_supports_group_ids
from .admin import AdminError, find_admin
from .cluster import LocalCluster
from .environment import native_environment, rpc_timeout_ms
from .master import LocalMaster, MasterEndpoints
from .master_address import MasterAddress, split_host_port
from .master_resolution import ResolvedMaster, resolve_master
from .reachability import check_reachable
from .registry import REGISTRY
from .replica_places import ReplicaPlaces
from .segment_liveness import SegmentLiveness
from .settings import DiskTier, MooncakeSettings, mib_text

__all__ = ["MooncakeError", "MooncakeStore"]

log = logging.getLogger(__name__)

#: setup()'s answer when this client mounts a disk and the master does not offload
UNABLE_OFFLOAD = -1300
INSTALL_HINT = "pip install 'kvpipe[mooncake]' (mooncake-transfer-engine-non-cuda==0.3.13.post1)"


class MooncakeError(RuntimeError):
    """The Mooncake client cannot be loaded or set up."""


def _import_mooncake() -> tuple[type, type]:
    """``(MooncakeDistributedStore, ReplicateConfig)``, or one error saying what to install.

    :raises MooncakeError: the wheel, or a system library it needs, is missing.
    """
    try:
        # untyped (a compiled module): pyproject's mypy overrides take what it gives as Any
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
        master: ResolvedMaster,
        drain_timeout_s: float = 60.0,
    ) -> None:
        """``client``: a native client set up on ``master``, which this store now owns (and
        stops on close, if spawned); ``config_cls``: the binding's ``ReplicateConfig``."""
        self._client = client
        self._config_cls = config_cls
        self._supports_group_ids = replicate_config_supports_group_ids(config_cls, config_cls())
        self._pin_enable = _soft_pin_enable(config_cls)
        self.settings = settings
        self.master_address = master.master_address
        self.metadata_server = master.metadata_server
        self._master = master
        self._drain_timeout_s = drain_timeout_s
        self._state = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self._users = 1  # open_shared hands the same store out again; close ends it for the last user
        self._shared_as: MooncakeSettings | None = None  # its key among the registry's shared stores
        # set when a call found the master gone (every key -900): see _master_back
        self._master_lost = False
        self._address = MasterAddress.parse(master.master_address)
        self.rpc_timeout_s = rpc_timeout_ms(settings) / 1000  # the deadline the client really has
        self._liveness = SegmentLiveness(probe_timeout_s=min(0.2, self.rpc_timeout_s))
        self._places = ReplicaPlaces()  # where present objects lie, for the liveness checks
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
        with ExitStack() as on_error:
            master = resolve_master(settings)
            on_error.callback(master.stop)
            address = MasterAddress.parse(master.master_address)
            check_reachable(address, master.metadata_server, settings.connect_timeout_s)
            REGISTRY.refuse_second_etcd(address)
            client = _set_up(client_cls, settings, master)
            REGISTRY.joined(address)
            on_error.pop_all()  # set up: the store owns the master now
        return cls(client, config_cls, settings=settings, master=master)

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
        with REGISTRY.shared_stores() as shared:
            store = shared.get(key)
            if store is not None:
                with store._state:
                    if not store._closed:
                        store._users += 1
                        return store
            store = cls.open(settings)
            store._shared_as = key
            shared[key] = store
            return store

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        spawned = " (spawned)" if self._master.spawned is not None else ""
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
        spawned = self._master.spawned
        return spawned if isinstance(spawned, LocalMaster) else None

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
        them apart (``verify_replicas``), at the cost of one more RPC when a key exists
        whose replicas' places it does not remember (:mod:`.replica_places`).
        A read may go to any of an object's replicas, and one that goes to a node cut
        off by the network (packets dropped, not refused) waits for the kernel to give
        up its connection, tens of seconds (measured: ~33 s): so an object is present
        only when every replica it may be read from is on a node that answers.
        """
        answers = self._master_call(len(keys), lambda c: c.batch_is_exist(list(keys)))
        if not self.settings.verify_replicas or EXISTS not in answers:
            return answers
        present = [key for key, answer in zip(keys, answers, strict=True) if answer == EXISTS]
        lost = self._on_lost_nodes(present)
        return [
            0 if answer == EXISTS and key in lost else answer
            for key, answer in zip(keys, answers, strict=True)
        ]

    def _on_lost_nodes(self, keys: list[str]) -> set[str]:
        """Those of ``keys`` with a replica on a node that does not accept connections.

        The master is asked where only the keys whose places are not remembered
        lie (:mod:`.replica_places`); a key it cannot say counts as readable.
        """
        if unknown := self._places.unknown(keys):
            replicas = self._replicas(unknown)
            if replicas is not None:
                from mooncake.store import ReplicaStatus

                self._places.learn(unknown, replicas, ReplicaStatus.COMPLETE)
        return self._liveness.lost_keys(keys, self._places.endpoints)

    def _replicas(self, keys: list[str]) -> dict[str, Any] | None:
        """The client's replica descriptors of ``keys``; None if it cannot give them (closed, or this wheel)."""
        if not self._enter():
            return None
        try:
            return self._client.batch_get_replica_desc(keys)  # type: ignore[no-any-return]
        except Exception:  # a descriptor this wheel cannot give: keep the master's word
            log.debug("mooncake: batch_get_replica_desc failed; replicas not verified", exc_info=True)
            return None
        finally:
            self._leave()

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

    def batch_put_session_start(self, keys: Sequence[str], sizes: Sequence[int], config: Any) -> list[int]:
        return self._master_call(len(keys), lambda c: c.batch_put_session_start(list(keys), list(sizes), config))

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        return self._batch(
            len(keys), lambda c: c.batch_put_from_multi_buffer_ranges(list(keys), ptrs, sizes, offsets)
        )

    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        return self._master_call(len(keys), lambda c: c.batch_put_session_end(list(keys)))

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        return self._master_call(len(keys), lambda c: c.batch_put_session_revoke(list(keys)))

    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        return self._master_call(len(keys), lambda c: c.batch_get_session_start(list(keys)))

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        return self._batch(
            len(keys), lambda c: c.batch_get_into_multi_buffer_ranges(list(keys), ptrs, sizes, offsets)
        )

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        return self._one(lambda c: c.batch_get_session_end(list(keys)))

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

    def capacity_bytes(self) -> int | None:
        """The bytes of objects the store's memory holds: every mounted segment, over each object's copies.

        Mooncake's client (0.3.13) has no call that says it, so the master's admin HTTP
        does (``/get_segments_detail``: each segment's capacity, whoever mounted it),
        read at :meth:`admin_endpoints`. An object takes ``replicas`` copies where
        there are that many segments. None when no admin address is known, none
        answers as a leader (each asked within the RPC deadline), or no segment is
        mounted: the caller's default then stands.
        """
        endpoints = self.admin_endpoints()
        if self._closed or not endpoints:
            return None
        try:
            segments = find_admin(endpoints, self.rpc_timeout_s).segments()
        except AdminError as error:
            log.warning("mooncake: the store's capacity cannot be read: %s", error)
            return None
        total = sum(segment.capacity_bytes for segment in segments or ())
        if not segments or total <= 0:
            return None
        return total // min(self.settings.replicas, len(segments))

    def admin_endpoints(self) -> list[tuple[str, int]]:
        """Where the master's admin HTTP is known to be: ``master_metrics``, then a spawned master's (or cluster's)."""
        known = [split_host_port(address) for address in self.settings.master_metrics]
        spawned = self._master.spawned
        masters = spawned.masters if isinstance(spawned, LocalCluster) else [spawned] if spawned else []
        known += [(m.endpoints.host, m.endpoints.metrics_port) for m in masters if m.endpoints is not None]
        return list(dict.fromkeys(known))

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
            if self._shared_as is not None:
                REGISTRY.forget(self._shared_as, self)
            drained = self._state.wait_for(lambda: self._in_flight == 0, timeout=self._drain_timeout_s)
        self._liveness.close()
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
        self._master.stop()

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


def _set_up(client_cls: type, settings: MooncakeSettings, master: ResolvedMaster) -> Any:
    """A new native client, set up on ``master`` as ``settings`` say.

    :raises MooncakeError: ``setup()`` fails (naming its code and the likely cause; the
        client is ended first); the disk tier's folder cannot be created.
    """
    client = client_cls()  # held here alone: a failed set-up ends it below
    extra: dict[str, Any] = {}
    if settings.tenant_id != "default":
        extra["tenant_id"] = settings.tenant_id
    if settings.disk is not None:
        extra.update(enable_ssd_offload=True, ssd_offload_path=_disk_folder(settings.disk))
    with native_environment(settings):
        code = client.setup(
            settings.local_hostname,
            master.metadata_server,
            settings.global_segment_size,
            settings.local_buffer_size,
            settings.protocol,
            settings.device_name,
            master.master_address,
            **extra,
        )
    if code != 0:
        # A failed set-up may leave the segment mounted (-1300 does): the destructor
        # unmounts it here, while the master serves, not when the error is collected.
        client.close()
        del client
        hint = _SETUP_HINTS.get(code, "see the client's log above")
        raise MooncakeError(
            f"Mooncake setup() failed with {describe(code)} for master {master.master_address}, "
            f"metadata {master.metadata_server}, protocol {settings.protocol!r}, "
            f"segment {mib_text(settings.global_segment_size)}: {hint}"
        )
    return client


def _disk_folder(disk: DiskTier) -> str:
    """The disk tier's folder, created if missing (Mooncake's client refuses a missing one).

    :raises MooncakeError: it cannot be created (naming the folder and why).
    """
    try:
        disk.path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MooncakeError(f"disk.path: cannot create {disk.path}: {exc.strerror or exc}") from None
    return str(disk.path)


def _release(native: list[Any], master: ResolvedMaster) -> None:
    """Close and end the client, then stop the master (or cluster) it was mounted on, if spawned (the unmount needs it).

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
        master.stop()
