"""How a Mooncake client joins the store: :class:`MooncakeSettings`, sizes, and vLLM's JSON file.

Settings are validated where they are read (a YAML ``store:`` section, a vLLM
``kv_connector_extra_config``, the JSON file ``MOONCAKE_CONFIG_PATH`` names), so a
bad value fails as one line naming the field, before any client is set up. Sizes
read as vLLM reads them (binary units whatever their spelling), so one file means
the same store to both connectors.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from .master import P2P_HANDSHAKE
from .master_address import MasterAddress, split_host_port

__all__ = [
    "MIN_SEGMENT_BYTES",
    "ClusterSpawn",
    "DiskTier",
    "MooncakeConfigError",
    "MooncakeSettings",
    "parse_size",
]

MiB = 1 << 20
MIN_SEGMENT_BYTES = 16 * MiB  # the client's floor: setup() returns -600 below it
CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
LOCAL_HOSTNAME_ENV = "MOONCAKE_REQUESTER_LOCAL_HOSTNAME"


class MooncakeConfigError(ValueError):
    """A vLLM Mooncake JSON file cannot be used; the message names the file and field."""


# -- sizes ---------------------------------------------------------------------------------

_SIZE = re.compile(r"^([\d.]+)\s*(gib|mib|kib|gb|mb|kb|b)?$")
_UNITS = {"gb": 1 << 30, "mb": 1 << 20, "kb": 1 << 10, "b": 1, "gib": 1 << 30, "mib": 1 << 20, "kib": 1 << 10}


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``"256MB"``, as vLLM's ``_parse_size`` reads it.

    Units are binary whatever their spelling (``"1MB"`` is 2**20, as in vLLM),
    case-insensitive, with optional spaces; ``KiB``/``MiB``/``GiB`` are accepted
    too. A fractional result is truncated to whole bytes, again as in vLLM.
    """
    if isinstance(value, bool):
        raise PydanticCustomError("size", "must be a size in bytes or a string such as '256MB', not a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if not isinstance(value, str):
        raise PydanticCustomError("size", "must be a size in bytes or a string such as '256MB'")
    match = _SIZE.match(value.strip().lower())
    if match is None:
        raise PydanticCustomError(
            "size", "must be a size such as 268435456, '256MB' or '1GB' (units B, KB, MB, GB)"
        )
    try:
        number = float(match.group(1))
    except ValueError:
        raise PydanticCustomError("size", "has no valid number before its unit") from None
    return int(number * _UNITS[match.group(2) or "b"])


def _segment_size(value: object) -> int:
    """A before-validator: :func:`parse_size`, then the client's floor, quoting what was written."""
    size = parse_size(value)
    if 0 < size < MIN_SEGMENT_BYTES or size < 0:
        raise PydanticCustomError(
            "segment_size",
            "must be 0 (mount no segment) or at least 16 MiB: the Mooncake client refuses a smaller "
            "segment (setup() returns -600), got {value} ({size} bytes)",
            {"value": repr(value), "size": size},
        )
    return size


def _buffer_size(value: object) -> int:
    size = parse_size(value)
    if size < 0:
        raise PydanticCustomError("buffer_size", "must be >= 0 bytes, got {value}", {"value": repr(value)})
    return size


def _positive_size(value: object) -> int:
    size = parse_size(value)
    if size <= 0:
        raise PydanticCustomError("size", "must be > 0 bytes, got {value}", {"value": repr(value)})
    return size


SegmentSize = Annotated[int, BeforeValidator(_segment_size)]
BufferSize = Annotated[int, BeforeValidator(_buffer_size)]
PositiveSize = Annotated[int, BeforeValidator(_positive_size)]


def mib_text(n: int) -> str:
    return f"{n / MiB:g} MiB"


def http_endpoint(metadata_server: str) -> tuple[str, int] | None:
    """The host and port of an HTTP metadata server, or None for other kinds."""
    parts = urlsplit(metadata_server)
    if parts.scheme not in ("http", "https"):
        return None
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


# -- settings ------------------------------------------------------------------------------


class DiskTier(BaseModel):
    """A local-disk segment behind a client's memory one: Mooncake's SSD offload.

    The master has the client write the objects it evicts from the client's memory
    segment to ``path`` (Mooncake's offload on evict), and lookups and loads find
    them there, from any client. At most ``size`` bytes are kept on disk: past that,
    the least recently read objects go. ``read_buffer`` is memory the disk's owner
    reads objects into before they travel to the reader; one load call whose objects
    on this disk need more fails for every key it names (Mooncake's -10), so it must
    hold the largest load.

    ``path`` is made absolute (Mooncake takes no other) and is created at set-up if
    missing, so it must be a folder or creatable: a validation error says why not.
    Give each client a folder of its own: at set-up a client reports the objects it
    finds in its folder to the master as its own.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path = Field(
        description="The disk tier's folder (made absolute; created if missing): one per client."
    )
    size: PositiveSize = Field(
        description="Bytes the tier keeps at most; past it the least recently read go."
    )
    read_buffer: PositiveSize = Field(
        256 * MiB,
        description="Memory the disk's owner reads objects into before they travel: one load call's objects "
        "on this disk must fit (else Mooncake's -10 for every key of the call).",
    )

    @field_validator("path")
    @classmethod
    def _usable_folder(cls, value: Path) -> Path:
        path = Path(os.path.abspath(value.expanduser()))
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            what = "is a file" if existing == path else f"cannot be created: {existing} is a file"
            raise PydanticCustomError(
                "disk_path", "{what}, not a folder, got {value}", {"what": what, "value": str(value)}
            )
        if not os.access(existing, os.W_OK | os.X_OK):
            what = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
            raise PydanticCustomError("disk_path", "{what}, got {value}", {"what": what, "value": str(value)})
        return path

    def mooncake_environment(self) -> dict[str, str]:
        """The variables Mooncake's client reads its disk tier from, once, in ``setup()``.

        - bucket files (Mooncake's recommended backend, the one with a size cap), one
          object per bucket: a bucket is written once it holds its key limit (500 by
          default), so a segment holding fewer objects than that never writes one, and
          with offload on evict no put finds room again;
        - ``size`` as the cap, the least recently read bucket going first, and no
          proactive eviction at 90% of the cap (the cap alone bounds the disk);
        - a heartbeat every second: objects reach the disk on the heartbeat, and puts
          into a full memory segment fail (-200) until they have (10 s by default);
        - ``read_buffer`` as the staging buffer (1.25 GiB by default, all resident).
        """
        return {
            "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
            "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "1",
            "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(self.size),
            "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "lru",
            "MOONCAKE_OFFLOAD_ENABLE_DISK_WATERMARK_EVICTION": "false",
            "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
            "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(self.read_buffer),
        }


class ClusterSpawn(BaseModel):
    """A local cluster for ``master: spawn``: etcd, ``masters`` HA masters, ``store_nodes`` nodes.

    With ``node_disk``, each store node also mounts a disk tier of that size, in a
    folder of the cluster's own (removed with it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    masters: int = Field(2, ge=1, le=5, description="HA masters on one etcd (1 to 5).")
    store_nodes: int = Field(
        1, ge=0, le=16, description="`kvpipe store` nodes that hold the objects (0 to 16)."
    )
    node_segment: SegmentSize = Field(
        256 * MiB, description="Memory each store node lends (at least 16 MiB)."
    )
    node_disk: PositiveSize | None = Field(
        None, description="A disk tier of this size on every store node (docs/ssd-tier.md); null: none."
    )

    @field_validator("node_segment")
    @classmethod
    def _lends_memory(cls, value: int) -> int:
        if value == 0:
            raise PydanticCustomError("node_segment", "must be at least 16 MiB: a store node lends memory")
        return value


class MooncakeSettings(BaseModel):
    """Where the store is and how the client joins it.

    ``master`` is ``"spawn"`` (a local master on free loopback ports, stopped
    with the store; its knobs are ``lease_ttl_ms``, ``eviction_high_watermark``,
    ``eviction_ratio`` and ``client_ttl_s``) or the ``host:port`` of a running
    master, which then needs ``metadata_server`` too. ``cluster`` (with ``spawn`` only)
    spawns a local HA cluster instead (:class:`ClusterSpawn`); its store nodes hold
    the objects, so this client may mount no segment. Sizes are bytes or
    strings such as ``"256MB"`` (binary units, as vLLM reads them).

    Objects live in the segments clients mount (``global_segment_size``), and
    a closing client takes its segment's objects with it. A segment of 0
    mounts none: this client then stores into the segments of longer-lived
    clients (a ``kvpipe store`` node, :mod:`.store_node`), so its objects outlive
    it, which is vLLM's ``standalone-store`` mode.

    ``replicas`` is Mooncake's replica count for every put (``ReplicateConfig.replica_num``):
    with 2 or more, each object lives in that many segments (of different store
    nodes where there are enough), so losing one node loses no object. The
    master places what it can: fewer segments than ``replicas`` store fewer
    copies, not an error. ``verify_replicas`` makes lookups count no object with a
    replica a read may go to on a store node that is gone (:mod:`.segment_liveness`).

    ``disk`` mounts a local-disk segment behind this client's memory one
    (:class:`DiskTier`): what the master evicts from memory goes there instead of
    away. The master must run with ``--enable_offload=true`` (a spawned one does).

    ``master_metrics`` are the ``host:port`` of the masters' admin HTTP (their
    ``--metrics_port``, 9003 unless set; one per HA master): where the client reads
    the store's capacity, which Mooncake's client API does not give
    (:meth:`~.client.MooncakeStore.capacity_bytes`; a spawned master's is known
    without it). Nothing else reads them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    master: Literal["spawn"] | str = Field(
        "spawn",
        description="`spawn` (a local master on free loopback ports, stopped with the store), the `host:port` "
        "of a running master, or HA masters: `etcd://h1:p1;h2:p2` or `redis://host:port`.",
    )
    metadata_server: str | None = Field(
        default=None,
        validate_default=True,
        description="The transfer engine's metadata: `P2PHANDSHAKE` or `http://host:port/metadata`; "
        "required with an existing master.",
    )
    cluster: ClusterSpawn | None = Field(
        None,
        description="With `master: spawn`: a local HA cluster instead (etcd, masters, store nodes on loopback; "
        "`store.cluster` below).",
    )
    protocol: str = Field(
        "tcp", description="The transfer engine's protocol (`tcp`; `rdma` where there is one)."
    )
    device_name: str = Field("", description="The RDMA device(s) to use; empty for TCP.")
    global_segment_size: SegmentSize = Field(
        256 * MiB,
        description="Memory this client lends the store (0, or at least 16 MiB). 0 mounts none (vLLM's "
        "standalone-store mode): objects then live in store nodes' segments (`kvpipe store`), and outlive "
        "this client.",
    )
    local_buffer_size: BufferSize = Field(
        64 * MiB, description="The client's transfer buffer (Mooncake's `local_buffer_size`)."
    )
    local_hostname: str = Field(
        "127.0.0.1",
        description="This client's address in the store, which other clients connect to: set it for a store "
        "of several hosts.",
    )
    tenant_id: str = Field("default", description="Mooncake's tenant: tenants share no objects.")
    connect_timeout_s: float = Field(
        5.0,
        gt=0,
        description="How long opening the store waits for a master that serves (and an HTTP metadata server) "
        "before it fails in one line, where Mooncake's set-up would retry for ~90 s.",
    )
    rpc_timeout_ms: int = Field(
        2000, gt=0, description="A stopped master costs a call this long, not Mooncake's 30 s."
    )
    # A TCP transfer that makes no progress this long fails (-800): a store node cut off
    # by the network costs a load or a put this long, not Mooncake's 30 s default.
    transfer_timeout_s: int = Field(
        3,
        gt=0,
        description="A transfer that makes no progress this long fails (-800): a store node cut off by the "
        "network costs a get or a put this long, not Mooncake's 30 s.",
    )
    lease_ttl_ms: int | None = Field(
        None, ge=0, description="A spawned master's read lease (`--default_kv_lease_ttl`); null: its default."
    )
    eviction_high_watermark: float | None = Field(
        None, gt=0, le=1, description="A spawned master's eviction watermark; null: its default (0.9)."
    )
    eviction_ratio: float | None = Field(
        None, ge=0, le=1, description="A spawned master's share evicted per pass; null: its default."
    )
    client_ttl_s: int | None = Field(
        None,
        gt=0,
        description="A spawned master's client TTL: how long a dead client's objects stay listed; null: its default (10 s).",
    )
    replicas: int = Field(
        1,
        ge=1,
        le=16,
        description="Mooncake's `replica_num` for every put: copies of each object, on different nodes where "
        "there are enough (fewer nodes: fewer copies).",
    )
    verify_replicas: bool = Field(
        True,
        description="Lookups count no object with a copy a read may go to on a store node that does not answer.",
    )
    disk: DiskTier | None = Field(
        None,
        description="A local-disk segment behind this client's memory one (`store.disk` below, docs/ssd-tier.md); "
        "null: none.",
    )
    master_metrics: tuple[str, ...] = Field(
        (),
        description="`host:port` of the masters' admin HTTP (`--metrics_port`; one per HA master): where the "
        "store's capacity is read (retention's default budget, docs/retention.md).",
    )

    @field_validator("master")
    @classmethod
    def _master_address(cls, value: str) -> str:
        if value == "spawn":
            return value
        try:
            return MasterAddress.parse(value).text
        except ValueError as exc:
            raise PydanticCustomError("master_address", str(exc)) from None

    @field_validator("metadata_server")
    @classmethod
    def _metadata_server(cls, value: str | None, info: ValidationInfo) -> str | None:
        master = info.data.get("master")
        if value is None:
            if master is not None and master != "spawn":
                raise PydanticCustomError(
                    "missing_metadata_server",
                    "is required with an existing master: 'http://host:port/metadata' or 'P2PHANDSHAKE'",
                )
            return None
        value = value.strip()
        if value == P2P_HANDSHAKE:
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https", "etcd", "redis") or not parts.hostname:
            raise PydanticCustomError(
                "metadata_server", "must be 'P2PHANDSHAKE' or a URL such as 'http://host:port/metadata'"
            )
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise PydanticCustomError("metadata_server", "has an invalid port") from None
        return value

    @field_validator("master_metrics")
    @classmethod
    def _metrics_addresses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for address in value:
            try:
                split_host_port(address)
            except ValueError:
                raise PydanticCustomError(
                    "master_metrics",
                    "must list 'host:port' of the masters' admin HTTP (their --metrics_port), got {address}",
                    {"address": repr(address)},
                ) from None
        return tuple(address.strip() for address in value)

    @field_validator("protocol", "local_hostname", "tenant_id")
    @classmethod
    def _word(cls, value: str) -> str:
        if not value.strip() or any(c.isspace() for c in value.strip()):
            raise PydanticCustomError("word", "must be a non-empty word without spaces")
        return value.strip()

    @field_validator("global_segment_size")
    @classmethod
    def _segment_somewhere(cls, value: int, info: ValidationInfo) -> int:
        cluster = info.data.get("cluster")
        if value == 0 and info.data.get("master") == "spawn" and (cluster is None or not cluster.store_nodes):
            raise PydanticCustomError(
                "no_segment",
                "is 0 (mount no segment), but a spawned master has no other client to hold objects: "
                "give it at least 16 MiB, spawn a cluster with store nodes (cluster: {store_nodes: 1}), "
                "or use an existing master",
            )
        return value

    @field_validator("disk")
    @classmethod
    def _disk_behind_memory(cls, value: DiskTier | None, info: ValidationInfo) -> DiskTier | None:
        if value is not None and info.data.get("global_segment_size") == 0:
            raise PydanticCustomError(
                "disk_without_segment",
                "needs a memory segment in front of it (global_segment_size > 0): objects reach the "
                "disk when the master evicts them from this client's segment, got a segment of 0",
            )
        return value

    @field_validator("cluster", "lease_ttl_ms", "eviction_high_watermark", "eviction_ratio", "client_ttl_s")
    @classmethod
    def _spawn_only(cls, value: object, info: ValidationInfo) -> object:
        master = info.data.get("master")
        if value is not None and master is not None and master != "spawn":
            raise PydanticCustomError(
                "spawn_only",
                "configures a spawned master only (master: spawn); set it on the master at {master}",
                {"master": master},
            )
        return value

    @classmethod
    def from_vllm_file(
        cls, path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None, **overrides: Any
    ) -> Self:
        """Settings from vLLM's Mooncake JSON file, the one ``MOONCAKE_CONFIG_PATH`` names.

        Fields and defaults are vLLM's (``protocol`` "rdma", sizes 4 GiB when
        missing), so one file means the same store to both. ``metadata_server``
        and ``master_server_address`` are required: vLLM would pass them empty
        to ``setup()`` and fail there. ``mode`` is "embedded" (this client
        mounts a segment) or "standalone-store" (``global_segment_size`` 0:
        objects live in a store service's segments), checked as vLLM checks
        it. ``enable_offload`` is accepted and changes nothing here: vLLM
        passes it to no Mooncake call either (it sizes vLLM's own staging
        buffers). Unknown fields are errors. The local host name comes from
        ``MOONCAKE_REQUESTER_LOCAL_HOSTNAME`` when set (vLLM falls back to the
        machine's IP, kvpipe to 127.0.0.1: set it for a multi-node store).
        ``overrides`` are settings fields (e.g. ``connect_timeout_s``).
        Raises :class:`MooncakeConfigError` naming the file and the field.
        """
        env = os.environ if env is None else env
        where = str(path)
        try:
            document = json.loads(Path(path).read_text())
        except OSError as exc:
            raise MooncakeConfigError(
                f"{where}: cannot read the Mooncake config: {exc.strerror or exc}"
            ) from None
        except json.JSONDecodeError as exc:
            raise MooncakeConfigError(f"{where}: not valid JSON: {exc}") from None
        if not isinstance(document, dict):
            raise MooncakeConfigError(f"{where}: must hold a JSON object, got {type(document).__name__}")
        problems = [f"{where}: {name}: is required" for name in _VLLM_REQUIRED if name not in document]
        for name, value in document.items():
            if name not in (*_VLLM_FIELDS, *_VLLM_ONLY):
                known = ", ".join([*_VLLM_FIELDS, *_VLLM_ONLY])
                problems.append(f"{where}: {name}: is not a known field (known: {known}), got {value!r}")
            elif name in _VLLM_ONLY and value not in _VLLM_ONLY[name]:
                allowed = " or ".join(repr(v) for v in _VLLM_ONLY[name])
                problems.append(f"{where}: {name}: must be {allowed}, got {value!r}")
        if problems:
            raise MooncakeConfigError("\n".join(problems))
        fields = {_VLLM_FIELDS[name]: value for name, value in document.items() if name in _VLLM_FIELDS}
        for name, default in _VLLM_DEFAULTS.items():
            fields.setdefault(_VLLM_FIELDS[name], default)
        if hostname := env.get(LOCAL_HOSTNAME_ENV):
            fields["local_hostname"] = hostname
        fields.update(overrides)
        try:
            settings = cls.model_validate(fields)
        except ValidationError as exc:
            names = {field: name for name, field in _VLLM_FIELDS.items()}
            names["local_hostname"] = f"local_hostname (${LOCAL_HOSTNAME_ENV})"
            lines = []
            for problem in exc.errors():
                field = str(problem["loc"][0]) if problem["loc"] else ""
                line = f"{where}: {names.get(field, field)}: {problem['msg']}"
                lines.append(line if ", got " in line else f"{line}, got {problem['input']!r}")
            raise MooncakeConfigError("\n".join(lines)) from None
        mode = document.get("mode", "embedded")
        if (mode == "standalone-store") != (settings.global_segment_size == 0):
            raise MooncakeConfigError(
                f"{where}: mode: {mode!r} needs global_segment_size "
                f"{'0' if mode == 'standalone-store' else '> 0'} (as in vLLM), "
                f"got {document.get('global_segment_size', _VLLM_DEFAULTS['global_segment_size'])!r}"
            )
        return settings

    @classmethod
    def from_vllm_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """:meth:`from_vllm_file` on the file ``MOONCAKE_CONFIG_PATH`` names."""
        env = os.environ if env is None else env
        path = env.get(CONFIG_PATH_ENV)
        if not path:
            raise MooncakeConfigError(f"${CONFIG_PATH_ENV} is not set: it names vLLM's Mooncake JSON config")
        return cls.from_vllm_file(path, env=env, **overrides)


# vLLM JSON field -> settings field, the ones vLLM reads that kvpipe can honour as they are.
_VLLM_FIELDS = {
    "metadata_server": "metadata_server",
    "master_server_address": "master",
    "protocol": "protocol",
    "device_name": "device_name",
    "global_segment_size": "global_segment_size",
    "local_buffer_size": "local_buffer_size",
    "tenant_id": "tenant_id",
}
_VLLM_REQUIRED = ("metadata_server", "master_server_address")
_VLLM_DEFAULTS: dict[str, Any] = {
    "protocol": "rdma",
    "device_name": "",
    "global_segment_size": 4 << 30,
    "local_buffer_size": 4 << 30,
}
# Fields vLLM reads that set no client parameter: the values kvpipe accepts.
_VLLM_ONLY: dict[str, tuple[object, ...]] = {
    "mode": ("embedded", "standalone-store"),
    "enable_offload": (False, True),
}
