"""``kvpipe inspect``: what a live Mooncake store holds of one model's KV cache.

Why: a cache is worth what a lookup can hit, and a lookup hits a chunk only when
every object of it is stored: every storable group of every rank (the shards).
The bench's ``fragmentation`` workload measures how much of a store is chunks cut
in pieces; this is the same figure on a real deployment, for an operator asking
"is my cache whole, how big is it, where does it live, is the store shared?".

Where it comes from: the master's admin HTTP server only (``--metrics_port``,
9003 by default), never a Mooncake client (but to verify, below). On the master
this was written against (mooncake-transfer-engine-non-cuda 0.3.13.post1) it serves, among
others, ``/get_all_keys`` (every key, one a line), ``/batch_query_keys?keys=a,b``
(per key its replicas: ``size_``, ``transport_endpoint_``), ``/get_segments_detail``
(per mounted segment: name, ``te_endpoint``, capacity, used bytes) and ``/role``.
Unlike a client's ``batch_get_replica_desc``, ``get_size`` or ``batch_is_exist``
(and the admin ``/query_key``), ``/batch_query_keys`` grants no read lease
(measured: a ``remove`` right after it succeeds, after the others it is -706),
so inspecting a store (without verifying) does not change what it evicts next. Keys are asked for
in batches of :data:`QUERY_BATCH`, so thousands of keys cost a few requests.

The figures (:class:`InspectReport`, whose :meth:`~InspectReport.as_json` field
names are stable):

- ``objects``, ``bytes``, ``replicas``: the model's objects (keys in the one key
  format, :func:`~kvpipe.stages.keys.parse_object_key`, with this model part and
  cache prefix), their bytes (each counted once), and their replicas (with
  ``replicas: 2`` an object counts twice here).
- ``seals``: the seals (:mod:`~kvpipe.stages.integrity`, key = object key +
  ``@kvpipe-seal``) of the model's objects still stored, and their bytes. They
  count in no other figure: not as objects, bytes, chunks or other keys.
- ``other_keys``: every other key in the store; ``other_models`` those in the
  key format (model and cache prefix, with counts; a seal counts with the model
  of its object), ``unparsed_keys`` the rest. A store shared with other models
  or tools shows here.
- ``shards``: the shards a chunk is expected to have, and where that comes from:
  ``seen`` (the union of (store group, tp/pcp/dcp/pp rank) of the model's keys),
  ``flags`` (``store_groups``/``tp_ranks`` given) or ``run`` (a ``kvpipe run``
  config's workload regenerated: :func:`expected_objects`; each chunk then has
  exactly the objects the job offers for it, e.g. a mamba state only where the
  engine's state stood).
- ``chunks``: :class:`~.run.check.ChunkCounts`, counted by the run report's own
  rule (:func:`~.run.check.count_chunks`): complete (every expected object
  stored), partial (some), absent (none). Absent is only knowable from a list of
  chunks that should be there, so it is ``None`` unless a run config is given.
- ``bytes_by_chunk``: bytes of the model's objects in complete chunks, in partial
  chunks (memory no lookup can use: the fragmentation figure, also as
  ``partial_ratio`` of both), and ``unexpected`` (objects outside the expected
  shards or, with a run config, not among the run's objects).
- ``store_groups``: objects and bytes per store group (``group:{g}`` in the key).
- ``group_ids``: whether the installed Mooncake client takes ``group_ids``
  (:func:`~kvpipe.connector.store.protocol.replicate_config_supports_group_ids`) and, with a run config,
  whether that run asks for them. Which stored objects carry a group id is NOT
  observable: neither the admin HTTP nor the client exposes an object's group,
  so no per-object coverage is reported (``per_object`` is always ``None``).
- ``nodes``: per segment the master lists (a store node or a client that mounts
  memory): the model's replicas there and their bytes (complete / partial chunk
  bytes too), the segment's used and total bytes (every model), and whether its
  transfer endpoint accepts a TCP connection now (a node that died keeps its
  objects listed for the master's client TTL, ~10 s, though none can be read).
- ``verify`` (``None`` unless asked, :class:`Scrub`): the scrubber. A Mooncake
  client that mounts no segment reads the model's objects (all, or a random
  sample), each with its seal in the same ``batch_get_into_multi_buffers`` call,
  and judges the bytes against the seal (:func:`~kvpipe.stages.integrity.judge`,
  no fingerprint: any configuration's seal is checked). Each object is ``ok``
  (its seal vouches for it), ``corrupt`` (its bytes, size or seal are not what
  its writer sealed), ``unverified`` (no seal: vLLM's connector wrote it, or
  its seal is gone) or ``unreadable`` (the object or its seal could not be read:
  ``unreadable_reasons`` counts the codes). Per node (``nodes[].verify``) an
  object's verdict counts on every node holding a replica of it (which replica a
  read was served from is not observable). ``fingerprints`` counts the seals
  read per configuration fingerprint: more than one under one model name means
  engines of different configurations write the same keys. With ``repair``,
  every object of a chunk with a corrupt object (every store group and rank, as
  listed) and their seals are removed (forced: reads lease what they read, for
  the master's lease TTL), and the other figures still show the store as it was.

Errors: :class:`InspectError` (a ValueError) names the input (``master``,
``metrics``, ``model``, ``run``, ``verify``) and says what is wrong in one line, within the
HTTP timeout: no call here can wait the ~90 s a Mooncake ``setup()`` retries (the
verifying client is set up only once its master answered, within ``connect_timeout_s``).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import random
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from kvpipe.connector.store.configs import MooncakeStoreConfig, connect
from kvpipe.connector.store.mooncake import MasterError, MooncakeError
from kvpipe.connector.store.mooncake.master import is_listening
from kvpipe.connector.store.mooncake.master_address import MasterAddress, split_host_port
from kvpipe.connector.store.protocol import Store
from kvpipe.pipeline.config import one_line
from kvpipe.stages import MAX_BUFFERS_PER_CALL, KeyNamespace, StoreObject, key_model_name, object_key
from kvpipe.stages.integrity import SEAL_SIZE, Integrity, Seal, Verdict, judge
from kvpipe.stages.keys import is_seal_key, parse_object_key, seal_key, sealed_key
from kvpipe.stages.store import Code, describe

from .run.check import ChunkCounts, count_chunks

if TYPE_CHECKING:
    from .run.config import RunConfig

__all__ = [
    "ADMIN_DEFAULT_PORT",
    "AdminClient",
    "InspectError",
    "InspectReport",
    "NodeFigures",
    "Replica",
    "Scrub",
    "Segment",
    "ShardId",
    "Verification",
    "admin_of_master",
    "build_report",
    "check_master",
    "expected_objects",
    "find_admin",
    "render_table",
    "scrub_client",
    "write_png",
]

#: the master's ``--metrics_port`` when it is started without one
ADMIN_DEFAULT_PORT = 9003
#: keys per ``/batch_query_keys`` request (~130 bytes a key: URLs of ~64 KiB; 3000 keys measured fine)
QUERY_BATCH = 512
#: bytes of objects one verifying read brings at most (one registered buffer of this size, reused)
SCRUB_CALL_BYTES = 64 << 20
#: a verification reports its progress every this many objects read
PROGRESS_EVERY = 5000
#: what a verification finds an object to be (the module docstring says what each means)
SCRUB_VERDICTS = ("ok", "corrupt", "unverified", "unreadable")
_VERDICT_NAMES = {Verdict.VERIFIED: "ok", Verdict.CORRUPT: "corrupt", Verdict.UNVERIFIED: "unverified"}


class InspectError(ValueError):
    """An input that does not lead to a report; ``field`` names it (``master``, ``metrics``, ``model``, ``run``,
    ``verify``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# -- the master's admin HTTP ---------------------------------------------------------------


class Replica(NamedTuple):
    """One copy of an object, as ``/batch_query_keys`` lists it."""

    size: int
    endpoint: str  # the transfer endpoint of the segment holding it; "" when not in memory


@dataclass(frozen=True)
class Segment:
    """A mounted segment, as ``/get_segments_detail`` lists it."""

    name: str
    endpoint: str
    capacity_bytes: int
    used_bytes: int


class AdminClient:
    """The admin HTTP server of one master at ``host:port``; every call raises :class:`InspectError` (``metrics``)."""

    def __init__(self, host: str, port: int, timeout_s: float = 5.0) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _get(self, path: str, *, missing_ok: bool = False) -> str | None:
        url = f"http://{self.host}:{self.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as answer:  # noqa: S310 - the operator's master
                return answer.read().decode(errors="replace")
        except urllib.error.HTTPError as error:
            if missing_ok and error.code == 404:
                return None
            raise InspectError(
                "metrics",
                f"the master's admin HTTP at {self.address} answered {error.code} to {path.split('?')[0]}",
            ) from None
        except (OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise InspectError(
                "metrics",
                f"no master admin HTTP answers at {self.address} ({reason}; waited at most {self.timeout_s:g} s)",
            ) from None

    def role(self) -> str | None:
        """``leader`` or ``standby`` (HA), as ``/role`` says; None if this master has no such page."""
        text = self._get("/role", missing_ok=True)
        return None if text is None else text.strip()

    def keys(self) -> list[str]:
        """Every key the master holds (``/get_all_keys``)."""
        return [line for line in (self._get("/get_all_keys") or "").splitlines() if line.strip()]

    def replicas(self, keys: Sequence[str]) -> dict[str, list[Replica]]:
        """The replicas of each of ``keys`` that is still stored (``/batch_query_keys``, batched).

        A key gone since it was listed (evicted, removed) is left out. Keys must
        hold no comma (the endpoint's separator); keys in kvpipe's format hold none.
        """
        found: dict[str, list[Replica]] = {}
        for start in range(0, len(keys), QUERY_BATCH):
            batch = keys[start : start + QUERY_BATCH]
            query = urllib.parse.quote(",".join(batch), safe="@:,")
            document = self._json(f"/batch_query_keys?keys={query}")
            data = document.get("data") if isinstance(document, dict) else None
            if not isinstance(data, dict):
                raise InspectError(
                    "metrics", f"the master at {self.address} answered /batch_query_keys without data"
                )
            for key in batch:
                entry = data.get(key)
                if not isinstance(entry, dict) or not entry.get("ok"):
                    continue
                copies = [
                    Replica(int(value.get("size_", 0)), str(value.get("transport_endpoint_", "")))
                    for value in entry.get("values") or []
                ]
                copies += [
                    Replica(int(value.get("size_", 0)), "") for value in entry.get("disk_values") or []
                ]
                if copies:
                    found[key] = copies
        return found

    def segments(self) -> list[Segment] | None:
        """The mounted segments (``/get_segments_detail``); None if this master has no such page."""
        text = self._get("/get_segments_detail", missing_ok=True)
        if text is None:
            return None
        document = self._parse(text, "/get_segments_detail")
        return [
            Segment(
                str(entry.get("segment_name", "")),
                str(entry.get("te_endpoint", "")),
                int(entry.get("allocator_capacity_bytes", entry.get("size_bytes", 0))),
                int(entry.get("allocator_used_bytes", 0)),
            )
            for entry in (document.get("segments") or [] if isinstance(document, dict) else [])
        ]

    def _json(self, path: str) -> Any:
        return self._parse(self._get(path) or "", path.split("?")[0])

    def _parse(self, text: str, path: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise InspectError(
                "metrics", f"the master at {self.address} answered {path} with no JSON"
            ) from None


def find_admin(candidates: Sequence[tuple[str, int]], timeout_s: float = 5.0) -> AdminClient:
    """The first of ``candidates`` (``(host, port)``) that answers and does not stand by (HA).

    Raises :class:`InspectError` (``metrics``) when none answers, or every one that
    answers is a standby (a standby's admin HTTP lists nothing of the store).
    """
    if not candidates:
        raise InspectError("metrics", "names no admin endpoint")
    problems: list[str] = []
    for host, port in candidates:
        admin = AdminClient(host, port, timeout_s)
        try:
            role = admin.role()
        except InspectError as error:
            problems.append(str(error))
            continue
        if role == "standby":
            problems.append(f"the master at {admin.address} stands by (its /role); give the leader's")
            continue
        return admin
    raise InspectError("metrics", "; ".join(problems))


def check_master(address: MasterAddress, timeout_s: float) -> None:
    """Raise :class:`InspectError` (``master``) unless a master serves at ``address`` (HA: a leader).

    One probe, bounded by ``timeout_s``: never the Mooncake client's ~90 s retry.
    """
    if address.serving(timeout_s):
        return
    if address.is_ha and not address.coordinators_listening(timeout_s):
        raise InspectError(
            "master", f"no coordinator of {address.text} listens (no connection within {timeout_s:g} s)"
        )
    what = "no master leads" if address.is_ha else "mooncake master is not reachable"
    raise InspectError("master", f"{what} at {address.text} (no connection within {timeout_s:g} s)")


def admin_of_master(address: MasterAddress, timeout_s: float) -> tuple[str, int]:
    """Where the admin HTTP of the master at ``address`` is when it was started with the default port.

    The leader's host (etcd says which) and :data:`ADMIN_DEFAULT_PORT`. Raises
    :class:`InspectError` (``metrics``) when that host cannot be known (redis).
    """
    leader = address.leader(timeout_s)
    if leader is None:
        raise InspectError(
            "metrics",
            f"is needed: the leader behind {address.text} cannot be found to guess its admin HTTP",
        )
    return leader[0], ADMIN_DEFAULT_PORT


# -- what a run should have stored -----------------------------------------------------------


class _KeyNames:
    """A store that holds only key names: they exist, nothing else does, and puts write nothing.

    It satisfies the Store protocol so that the job and :func:`count_chunks` run on
    it unchanged: a run replays against it without touching any store, and chunks
    are counted against a listing with the run report's own rule.
    """

    def __init__(self, names: Iterable[str] = (), *, supports_group_ids: bool = False) -> None:
        self._names = frozenset(names)
        self._supports_group_ids = supports_group_ids

    @property
    def supports_group_ids(self) -> bool:
        return self._supports_group_ids

    @property
    def local_transfers(self) -> bool:
        return True  # nothing is transferred: never gather

    def new_replicate_config(self, *, soft_pin_ttl_ms: int | None = None) -> Any:
        return _Config()

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return [1 if key in self._names else 0 for key in keys]

    def batch_put_from_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], config: Any
    ) -> list[int]:
        return [0] * len(keys)

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        return [Code.NOT_FOUND] * len(keys)

    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], config: Any
    ) -> list[int]:
        return [0] * len(keys)

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return [Code.NOT_FOUND] * len(keys)

    def get_size(self, key: str) -> int:
        return Code.NOT_FOUND

    def remove(self, key: str, *, force: bool = False) -> int:
        return Code.NOT_FOUND

    def remove_all(self) -> int:
        return 0

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return 0

    def register_buffer(self, addr: int, nbytes: int) -> int:
        return 0

    def unregister_buffer(self, addr: int) -> int:
        return 0

    def close(self) -> None:
        pass


class _Config:
    """A replicate config's fields, for puts that go nowhere."""

    replica_num = 1
    group_ids: list[str] | None = None


def client_supports_group_ids() -> bool | None:
    """Whether the installed Mooncake client's ReplicateConfig has ``group_ids``; None without the wheel."""
    try:
        from mooncake.store import ReplicateConfig
    except ImportError:
        return None
    from kvpipe.connector.store.protocol import replicate_config_supports_group_ids

    return replicate_config_supports_group_ids(ReplicateConfig, ReplicateConfig())


def expected_objects(config: RunConfig) -> list[StoreObject]:
    """Every object ``kvpipe run`` with ``config`` offers to save, regenerated; nothing is written.

    The job itself runs (same workload from the same seed, same engine stand-in,
    same save pipeline) against a store that holds nothing and whose puts write
    nothing (:class:`_KeyNames`), so the records are exactly the job's, chunk by
    chunk. It costs what the job costs without a store: its KV cache in memory
    (``kv_cache_bytes``) and the engine's steps (about a second for the shipped
    configs). Raises ValueError (``model.num_blocks`` too small, and the like).
    """
    from .run.job import run

    store = _KeyNames(supports_group_ids=bool(client_supports_group_ids()))
    result = run(config, store=store)  # type: ignore[arg-type]  # _KeyNames is a Store
    return [record for record, _ in result.objects.values()]


# -- the report --------------------------------------------------------------------------------


class ShardId(NamedTuple):
    """One shard of a chunk: a rank's object of a store group."""

    store_group: int
    tp: int
    pcp: int
    dcp: int
    pp: int


ShardSource = Literal["seen", "flags", "run"]


@dataclass
class NodeFigures:
    """One segment: the model's replicas in it, and the segment's own use."""

    segment: str | None
    endpoint: str
    replicas: int = 0
    bytes: int = 0
    complete_bytes: int = 0
    partial_bytes: int = 0
    used_bytes: int | None = None
    capacity_bytes: int | None = None
    reachable: bool | None = None
    verify: dict[str, int] | None = None  # per verdict, the objects read with a replica here

    def as_json(self) -> dict[str, Any]:
        return {
            "segment": self.segment,
            "endpoint": self.endpoint,
            "replicas": self.replicas,
            "bytes": self.bytes,
            "complete_bytes": self.complete_bytes,
            "partial_bytes": self.partial_bytes,
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "reachable": self.reachable,
            "verify": self.verify,
        }


@dataclass
class InspectReport:
    """What the store holds of one model and cache prefix (the module docstring says what each means)."""

    admin: str
    master: str | None
    model: str
    cache_prefix: str
    objects: int
    bytes: int
    replicas: int
    seals: int
    seal_bytes: int
    other_keys: int
    other_models: list[tuple[str, str, int]]  # (model, cache prefix, objects), most objects first
    unparsed_keys: int
    shard_source: ShardSource
    store_groups_expected: list[int]
    ranks_expected: list[tuple[int, int, int, int]]  # (tp, pcp, dcp, pp)
    expected_objects: int
    chunks: ChunkCounts
    absent_known: bool
    complete_bytes: int
    partial_bytes: int
    unexpected_objects: int
    unexpected_bytes: int
    per_store_group: dict[int, tuple[int, int]]  # store group -> (objects, bytes)
    client_supports_group_ids: bool | None
    run_requests_group_ids: bool | None
    run_config: str | None
    size_mismatches: int | None
    nodes: list[NodeFigures] = field(default_factory=list)
    verification: Verification | None = None

    @property
    def partial_ratio(self) -> float:
        live = self.complete_bytes + self.partial_bytes
        return self.partial_bytes / live if live else 0.0

    def as_json(self) -> dict[str, Any]:
        chunks = asdict(self.chunks) | ({} if self.absent_known else {"absent": None})
        return {
            "admin": self.admin,
            "master": self.master,
            "model": self.model,
            "cache_prefix": self.cache_prefix,
            "objects": self.objects,
            "bytes": self.bytes,
            "replicas": self.replicas,
            "seals": {"count": self.seals, "bytes": self.seal_bytes},
            "other_keys": self.other_keys,
            "other_models": [
                {"model": model, "cache_prefix": prefix, "objects": count}
                for model, prefix, count in self.other_models
            ],
            "unparsed_keys": self.unparsed_keys,
            "shards": {
                "source": self.shard_source,
                "store_groups": self.store_groups_expected,
                "ranks": [
                    dict(zip(("tp", "pcp", "dcp", "pp"), rank, strict=True)) for rank in self.ranks_expected
                ],
                "expected_objects": self.expected_objects,
            },
            "chunks": chunks,
            "bytes_by_chunk": {
                "complete": self.complete_bytes,
                "partial": self.partial_bytes,
                "partial_ratio": round(self.partial_ratio, 6),
                "unexpected": self.unexpected_bytes,
            },
            "unexpected_objects": self.unexpected_objects,
            "store_groups": [
                {"store_group": group, "objects": objects, "bytes": nbytes}
                for group, (objects, nbytes) in sorted(self.per_store_group.items())
            ],
            "group_ids": {
                "client_supports": self.client_supports_group_ids,
                "run_requests": self.run_requests_group_ids,
                "per_object": None,
                "note": "which objects carry a group id is not observable: the master exposes no object's group",
            },
            "run": None
            if self.run_config is None
            else {
                "config": self.run_config,
                "chunks": self.chunks.total,
                "objects": self.expected_objects,
                "size_mismatches": self.size_mismatches,
            },
            "nodes": [node.as_json() for node in self.nodes],
            "verify": None if self.verification is None else self.verification.as_json(),
        }


def build_report(
    admin: AdminClient,
    model: str,
    cache_prefix: str = "",
    *,
    store_groups: int | None = None,
    tp_ranks: int | None = None,
    expected: Sequence[StoreObject] | None = None,
    run_config: str | None = None,
    run_requests_group_ids: bool | None = None,
    master: str | None = None,
    probe_timeout_s: float = 0.5,
    scrub: Scrub | None = None,
) -> InspectReport:
    """The report on ``model`` (any spelling: its key part is used) under ``cache_prefix``.

    ``expected``: every object that should be stored (:func:`expected_objects`);
    then chunks are the run's and absent is counted. Otherwise each chunk seen is
    expected to have the union of the shards seen, or ``store_groups`` x ``tp_ranks``
    (pcp/dcp/pp ranks as seen) where given. ``scrub``: also read and verify the
    objects (and repair) as it says. Raises :class:`InspectError`:
    ``metrics`` when the admin HTTP fails, ``model`` when the store holds no
    object of the model and no ``expected`` says what it should hold (the message
    lists what the store does hold), ``verify`` when the scrub's read memory
    cannot be registered.
    """
    model = key_model_name(model)
    listed = admin.keys()
    ours: dict[str, ShardId] = {}
    seals: list[str] = []
    chunk_of: dict[str, bytes] = {}  # of the model's objects and seals
    others: Counter[tuple[str, str]] = Counter()
    unparsed = 0
    for key in listed:
        parts = parse_object_key(sealed_key(key))  # a seal is its object's model's
        if parts is None:
            unparsed += 1
            continue
        ns = parts.namespace
        if ns.model != model or ns.cache_prefix != cache_prefix:
            others[(ns.model, ns.cache_prefix)] += 1
            continue
        chunk_of[key] = parts.chunk_hash
        if is_seal_key(key):
            seals.append(key)
        else:
            ours[key] = ShardId(parts.store_group, ns.tp_rank, ns.pcp_rank, ns.dcp_rank, ns.pp_rank)
    if not ours and expected is None:
        held = ", ".join(
            f"{name!r} (cache prefix {prefix!r}): {count}" for (name, prefix), count in others.most_common(5)
        )
        holds = f"it holds {held}" if held else "it holds no object in kvpipe's key format"
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        raise InspectError(
            "model",
            f"the store holds no object of model {model!r} with cache prefix {cache_prefix!r}; "
            f"{holds}{more}" + (f" (and {unparsed} keys in no kvpipe format)" if unparsed else ""),
        )

    stored = admin.replicas([*ours, *seals])  # listed keys still stored, with their replicas
    present = {key: copies for key, copies in stored.items() if key in ours}
    size = {key: copies[0].size for key, copies in present.items()}
    seal_sizes = [stored[key][0].size for key in seals if key in stored]

    # What every chunk should hold.
    by_chunk: dict[bytes, list[StoreObject]] = {}
    source: ShardSource
    if expected is not None:
        source = "run"
        for record in expected:
            by_chunk.setdefault(record.chunk_hash, []).append(record)
        expected_keys = {record.key for record in expected}
        shard_set = {_shard_of(record.key) for record in expected}
    else:
        seen = {ours[key] for key in present}
        source = "seen" if store_groups is None and tp_ranks is None else "flags"
        shard_set = _expected_shards(seen, store_groups, tp_ranks)
        namespaces = {
            shard: KeyNamespace(model, cache_prefix, shard.tp, shard.pcp, shard.dcp, shard.pp)
            for shard in shard_set
        }
        chunks_seen = {chunk_of[key] for key in present if ours[key] in shard_set}
        for chunk_hash in sorted(chunks_seen):
            by_chunk[chunk_hash] = [
                StoreObject(
                    object_key(namespaces[shard], shard.store_group, chunk_hash),
                    chunk_hash,
                    shard.store_group,
                    (),
                )
                for shard in sorted(shard_set)
            ]
        expected_keys = {record.key for records in by_chunk.values() for record in records}

    # Each chunk by the run report's own rule, one chunk at a time to know its bytes.
    view = _KeyNames(present)
    tally: Counter[str] = Counter()
    state_of: dict[str, str] = {}
    for records in by_chunk.values():
        one = count_chunks(view, records)  # type: ignore[arg-type]  # _KeyNames is a Store
        state = "complete" if one.complete else "partial" if one.partial else "absent"
        tally[state] += 1
        for record in records:
            state_of[record.key] = state
    counts = ChunkCounts(len(by_chunk), tally["complete"], tally["partial"], tally["absent"])

    complete_bytes = sum(size[key] for key, state in state_of.items() if state == "complete" and key in size)
    partial_bytes = sum(size[key] for key, state in state_of.items() if state == "partial" and key in size)
    unexpected = [key for key in present if key not in expected_keys]
    per_group: dict[int, tuple[int, int]] = {}
    for key in present:
        objects, nbytes = per_group.get(ours[key].store_group, (0, 0))
        per_group[ours[key].store_group] = (objects + 1, nbytes + size[key])
    mismatches = None
    if expected is not None:
        mismatches = sum(1 for record in expected if record.key in size and size[record.key] != record.size)

    ranks = sorted({(shard.tp, shard.pcp, shard.dcp, shard.pp) for shard in shard_set})
    nodes = _nodes(admin.segments(), present, state_of, probe_timeout_s)
    verification = None if scrub is None else _verify(scrub, present, chunk_of, nodes)
    return InspectReport(
        admin=admin.address,
        master=master,
        model=model,
        cache_prefix=cache_prefix,
        objects=len(present),
        bytes=sum(size.values()),
        replicas=sum(len(copies) for copies in present.values()),
        seals=len(seal_sizes),
        seal_bytes=sum(seal_sizes),
        other_keys=len(listed) - len(ours) - len(seals),
        other_models=[(name, prefix, count) for (name, prefix), count in others.most_common()],
        unparsed_keys=unparsed,
        shard_source=source,
        store_groups_expected=sorted({shard.store_group for shard in shard_set}),
        ranks_expected=ranks,
        expected_objects=len(expected_keys),
        chunks=counts,
        absent_known=expected is not None,
        complete_bytes=complete_bytes,
        partial_bytes=partial_bytes,
        unexpected_objects=len(unexpected),
        unexpected_bytes=sum(size[key] for key in unexpected),
        per_store_group=per_group,
        client_supports_group_ids=client_supports_group_ids(),
        run_requests_group_ids=run_requests_group_ids,
        run_config=run_config,
        size_mismatches=mismatches,
        nodes=nodes,
        verification=verification,
    )


def _shard_of(key: str) -> ShardId:
    parts = parse_object_key(key)
    if parts is None:  # the run's keys are object_key's: cannot happen
        raise InspectError("run", f"the run makes a key in no known format: {key!r}")
    ns = parts.namespace
    return ShardId(parts.store_group, ns.tp_rank, ns.pcp_rank, ns.dcp_rank, ns.pp_rank)


def _expected_shards(seen: set[ShardId], store_groups: int | None, tp_ranks: int | None) -> set[ShardId]:
    """The union of ``seen``, with the store groups and/or tp ranks replaced by ``range(n)`` where given."""
    groups = sorted({s.store_group for s in seen}) if store_groups is None else list(range(store_groups))
    ranks = {(s.tp, s.pcp, s.dcp, s.pp) for s in seen}
    if tp_ranks is not None:
        rest = {(pcp, dcp, pp) for _, pcp, dcp, pp in ranks} or {(0, 0, 0)}
        ranks = {(tp, *other) for tp in range(tp_ranks) for other in rest}
    return {ShardId(group, *rank) for group in groups for rank in ranks}


def _nodes(
    segments: Sequence[Segment] | None,
    present: Mapping[str, Sequence[Replica]],
    state_of: Mapping[str, str],
    probe_timeout_s: float,
) -> list[NodeFigures]:
    """Per segment (every one the master lists, and any endpoint a replica names besides)."""
    nodes: dict[str, NodeFigures] = {}
    for segment in segments or []:
        nodes[segment.endpoint] = NodeFigures(
            segment.name,
            segment.endpoint,
            used_bytes=segment.used_bytes,
            capacity_bytes=segment.capacity_bytes,
        )
    for key, copies in present.items():
        for copy in copies:
            node = nodes.setdefault(copy.endpoint, NodeFigures(None, copy.endpoint))
            node.replicas += 1
            node.bytes += copy.size
            if state_of.get(key) == "complete":
                node.complete_bytes += copy.size
            elif state_of.get(key) == "partial":
                node.partial_bytes += copy.size
    for node in nodes.values():
        try:
            host, port = split_host_port(node.endpoint)
        except ValueError:
            continue  # not in memory, or no address: nothing to probe
        node.reachable = is_listening(host, port, timeout_s=probe_timeout_s)
    return sorted(nodes.values(), key=lambda node: (node.segment is None, node.segment or node.endpoint))


# -- verifying: the scrubber ----------------------------------------------------------------------


@contextmanager
def scrub_client(config: MooncakeStoreConfig) -> Iterator[Store]:
    """A client of the store ``config`` names that mounts no segment (kvpipe's :func:`connect`), closed on exit.

    Raises :class:`InspectError` (``verify``) when it cannot be opened.
    """
    try:
        store = connect(config, mount_segment=False)
    except (MasterError, MooncakeError) as error:
        raise InspectError(
            "verify", f"no Mooncake client opens on the master at {config.master}: {one_line(str(error))}"
        ) from None
    try:
        yield store
    finally:
        store.close()


@dataclass(frozen=True)
class Scrub:
    """What verifying asks: read objects through ``store`` (a :func:`scrub_client`) and judge them.

    ``sample``: that many of the model's objects, drawn at random (None: every
    one). ``repair``: remove the chunks found corrupt. ``on_progress(read, total)``
    is called every :data:`PROGRESS_EVERY` objects read.
    """

    store: Store
    sample: int | None = None
    repair: bool = False
    on_progress: Callable[[int, int], None] | None = None


@dataclass
class Verification:
    """What the objects read were found to be (per node: :attr:`NodeFigures.verify`)."""

    sample: int | None  # the sample asked for; None: every object
    objects: int = 0  # read
    bytes: int = 0
    verdicts: Counter[str] = field(default_factory=Counter)  # per :data:`SCRUB_VERDICTS` name
    unreadable_reasons: Counter[str] = field(default_factory=Counter)
    fingerprints: Counter[str] = field(default_factory=Counter)  # hex -> seals read
    corrupt_keys: list[str] = field(default_factory=list)
    corrupt_chunks: int = 0
    removed: int | None = None  # with repair: objects and seals removed
    remove_failures: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "sample": self.sample,
            "objects": self.objects,
            "bytes": self.bytes,
            **{name: self.verdicts[name] for name in SCRUB_VERDICTS},
            "unreadable_reasons": dict(self.unreadable_reasons.most_common()),
            "fingerprints": dict(self.fingerprints.most_common()),
            "corrupt_keys": self.corrupt_keys,
            "corrupt_chunks": self.corrupt_chunks,
            "repair": None
            if self.removed is None
            else {"removed": self.removed, "failed": self.remove_failures},
        }


class _Read(NamedTuple):
    """One object's verdict, with why it is unreadable or the fingerprint its seal names."""

    verdict: str
    reason: str | None = None
    fingerprint: str | None = None


def _verify(
    scrub: Scrub,
    present: Mapping[str, Sequence[Replica]],
    chunk_of: Mapping[str, bytes],
    nodes: Sequence[NodeFigures],
) -> Verification:
    """Read and judge the objects ``scrub`` asks for, count each verdict on the nodes of its replicas; repair.

    Each object and its seal are read in one call, a call holding at most
    :data:`MAX_BUFFERS_PER_CALL` buffers (two an object) and :data:`SCRUB_CALL_BYTES`
    of objects (or one object larger than that).
    """
    keys = sorted(present)
    if scrub.sample is not None and scrub.sample < len(keys):
        keys = sorted(random.sample(keys, scrub.sample))
    size = {key: present[key][0].size for key in keys}
    per_call = MAX_BUFFERS_PER_CALL // 2
    data_bytes = max(min(sum(size.values()), SCRUB_CALL_BYTES), max(size.values(), default=0))
    verification = Verification(scrub.sample)
    tally = {node.endpoint: Counter[str]() for node in nodes}
    with _registered(scrub.store, data_bytes + per_call * SEAL_SIZE) as base:
        seals = base + data_bytes
        for call in _calls(keys, size, per_call, data_bytes):
            addresses = list(itertools.accumulate((size[key] for key in call[:-1]), initial=base))
            seal_addresses = [seals + index * SEAL_SIZE for index in range(len(call))]
            results = scrub.store.batch_get_into_multi_buffers(
                [*call, *map(seal_key, call)],
                [[address] for address in [*addresses, *seal_addresses]],
                [[size[key]] for key in call] + [[SEAL_SIZE]] * len(call),
            )
            for index, key in enumerate(call):
                read = _judge_read(
                    size[key], addresses[index], results[index], seal_addresses[index], results[len(call) + index]
                )
                verification.verdicts[read.verdict] += 1
                if read.reason is not None:
                    verification.unreadable_reasons[read.reason] += 1
                if read.fingerprint is not None:
                    verification.fingerprints[read.fingerprint] += 1
                if read.verdict == "corrupt":
                    verification.corrupt_keys.append(key)
                for endpoint in {copy.endpoint for copy in present[key]}:
                    tally[endpoint][read.verdict] += 1
            before, verification.objects = verification.objects, verification.objects + len(call)
            if scrub.on_progress is not None and verification.objects // PROGRESS_EVERY > before // PROGRESS_EVERY:
                scrub.on_progress(verification.objects, len(keys))
            verification.bytes += sum(size[key] for key in call)
    for node in nodes:
        node.verify = {name: tally[node.endpoint][name] for name in SCRUB_VERDICTS}
    corrupt = {chunk_of[key] for key in verification.corrupt_keys}
    verification.corrupt_chunks = len(corrupt)
    if scrub.repair:
        doomed = sorted(key for key, chunk in chunk_of.items() if chunk in corrupt)  # objects and seals
        codes = [scrub.store.remove(key, force=True) for key in doomed]  # forced: the reads leased them
        verification.removed = sum(code == 0 for code in codes)
        verification.remove_failures = sum(code not in (0, Code.NOT_FOUND) for code in codes)
    return verification


def _judge_read(size: int, address: int, read: int, seal_address: int, seal_read: int) -> _Read:
    """The verdict on an object of ``size`` bytes read to ``address`` and its seal (the call's results).

    A seal object of another size is a damaged seal (corrupt), as a load judges it.
    """
    if read != size:
        return _Read("unreadable", describe(read) if read < 0 else f"read {read} bytes, not {size}")
    if seal_read == SEAL_SIZE:
        seal_bytes: bytes | None = ctypes.string_at(seal_address, SEAL_SIZE)
    elif seal_read == Code.NOT_FOUND:
        seal_bytes = None
    elif seal_read >= 0 or seal_read == Code.INVALID_PARAMS:
        seal_bytes = b""
    else:
        return _Read("unreadable", f"its seal: {describe(seal_read)}")
    verdict = judge(seal_bytes, [address], [size], None, Integrity.VERIFY)
    seal = None if seal_bytes is None else Seal.unpack(seal_bytes)
    return _Read(_VERDICT_NAMES[verdict], fingerprint=None if seal is None else seal.fingerprint.hex())


def _calls(keys: Sequence[str], size: Mapping[str, int], objects: int, nbytes: int) -> Iterator[list[str]]:
    """Runs of ``keys`` of at most ``objects`` keys and ``nbytes`` bytes (a larger object alone)."""
    call: list[str] = []
    used = 0
    for key in keys:
        if call and (len(call) == objects or used + size[key] > nbytes):
            yield call
            call, used = [], 0
        call.append(key)
        used += size[key]
    if call:
        yield call


@contextmanager
def _registered(store: Store, nbytes: int) -> Iterator[int]:
    """The address of ``nbytes`` of memory registered with ``store`` (a transfer touches only such memory)."""
    buffer = ctypes.create_string_buffer(nbytes)
    address = ctypes.addressof(buffer)
    code = store.register_buffer(address, nbytes)
    if code != 0:
        raise InspectError(
            "verify", f"registering {nbytes} bytes of read memory with the store failed: {describe(code)}"
        )
    try:
        yield address
    finally:
        store.unregister_buffer(address)


# -- showing it ----------------------------------------------------------------------------------


_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def _unit(nbytes: float) -> tuple[str, int]:
    """The largest binary unit that ``nbytes`` fills at least once (B for 0)."""
    return next(((name, scale) for name, scale in _UNITS if nbytes >= scale), ("B", 1))


def _size(nbytes: int) -> str:
    name, scale = _unit(nbytes)
    return f"{nbytes} B" if scale == 1 else f"{nbytes / scale:,.1f} {name}"


def _ranks(ranks: Sequence[tuple[int, int, int, int]]) -> str:
    """``tp 0, 1`` when only tp varies (pcp, dcp, pp all 0), else every rank spelt out."""
    if all(rank[1:] == (0, 0, 0) for rank in ranks):
        return "tp " + ", ".join(str(rank[0]) for rank in ranks) if ranks else "none"
    return ", ".join("tp{} pcp{} dcp{} pp{}".format(*rank) for rank in ranks)


def render_table(report: InspectReport) -> str:
    """The report as aligned text for a terminal."""
    r, c = report, report.chunks
    absent = (
        f"{c.absent:,} absent"
        if r.absent_known
        else "absent unknown (give --run CONFIG: the chunks expected)"
    )
    source = {
        "seen": "as seen in the store",
        "flags": "from --groups/--tp-ranks",
        "run": f"from --run {r.run_config}",
    }
    groups = ", ".join(str(g) for g in r.store_groups_expected) or "none"
    others = "; ".join(f"{model!r} (prefix {p!r}) {n:,}" for model, p, n in r.other_models[:4])
    if len(r.other_models) > 4:
        others += f"; {len(r.other_models) - 4} more"
    client = {True: "this Mooncake client supports them", False: "this Mooncake client has none"}.get(
        r.client_supports_group_ids, "no Mooncake client installed"
    )
    run = {True: "; the run asks for them", False: "; the run does not ask for them"}.get(
        r.run_requests_group_ids, ""
    )
    master = f", master {r.master}" if r.master else ""
    lines = [
        f"model         {r.model!r}, cache prefix {r.cache_prefix!r}  (admin HTTP {r.admin}{master})",
        f"objects       {r.objects:,} ({_size(r.bytes)}) in {r.replicas:,} replicas",
        f"seals         {r.seals:,} ({_size(r.seal_bytes)})",
        f"other keys    {r.other_keys:,}: {r.unparsed_keys:,} in no kvpipe/vLLM key format"
        + (f"; other models: {others}" if others else ""),
        f"chunks        {c.total:,}: {c.complete:,} complete, {c.partial:,} partial, {absent}",
        f"a chunk       store groups {groups} x {_ranks(r.ranks_expected)} ({source[r.shard_source]})",
        f"bytes         complete chunks {_size(r.complete_bytes)}, partial chunks {_size(r.partial_bytes)} "
        f"(partial/live {r.partial_ratio:.2%})",
    ]
    counts = [n for n, _ in r.per_store_group.values()]
    if r.shard_source != "run" and counts and 2 * min(counts) < max(counts):
        lines.append(
            "note          a store group holds under half the objects of another: a recurrent group (mamba) "
            "is stored at some chunks only, and those chunks count partial here; --run CONFIG knows which"
        )
    if r.unexpected_objects:
        lines.append(
            f"unexpected    {r.unexpected_objects:,} objects ({_size(r.unexpected_bytes)}) outside the expected shards"
            + (" (not among the run's)" if r.shard_source == "run" else "")
        )
    if r.size_mismatches:
        lines.append(
            f"WARNING       {r.size_mismatches:,} objects differ in size from the run's: another layout?"
        )
    lines += [
        "store groups  "
        + "; ".join(f"{g}: {n:,} objects, {_size(b)}" for g, (n, b) in sorted(r.per_store_group.items())),
        f"group ids     {client}{run}; which objects carry one is not observable",
    ]
    if r.verification is not None:
        lines += _verification_lines(r.verification, r.objects)
    verdicts = "" if r.verification is None else "".join(f" {name:>10}" for name in SCRUB_VERDICTS)
    lines += [
        "",
        f"{'node (segment)':<24} {'endpoint':<22} {'replicas':>9} {'bytes':>11} {'partial':>11} "
        f"{'segment used':>12} {'capacity':>11} {'reachable':>9}{verdicts}",
    ]
    for node in r.nodes:
        reachable = {True: "yes", False: "NO"}.get(node.reachable, "-")  # type: ignore[arg-type]
        used = "?" if node.used_bytes is None else _size(node.used_bytes)
        capacity = "?" if node.capacity_bytes is None else _size(node.capacity_bytes)
        found = "".join(f" {node.verify[name]:>10,}" for name in SCRUB_VERDICTS) if node.verify else ""
        lines.append(
            f"{node.segment or '(not listed)':<24} {node.endpoint or '(not in memory)':<22} {node.replicas:>9,} "
            f"{_size(node.bytes):>11} {_size(node.partial_bytes):>11} {used:>12} {capacity:>11} {reachable:>9}"
            f"{found}"
        )
    return "\n".join(lines)


def _verification_lines(v: Verification, objects: int) -> list[str]:
    read = f"{v.objects:,} of {objects:,} objects, a random sample" if v.objects < objects else f"{v.objects:,} objects"
    counts = ", ".join(f"{v.verdicts[name]:,} {name}" for name in SCRUB_VERDICTS)
    reasons = "; ".join(f"{reason}: {n:,}" for reason, n in v.unreadable_reasons.most_common())
    lines = [f"verified      {read} ({_size(v.bytes)}): {counts}" + (f" ({reasons})" if reasons else "")]
    if v.corrupt_keys:
        more = f" and {len(v.corrupt_keys) - 3:,} more" if len(v.corrupt_keys) > 3 else ""
        lines.append(
            f"corrupt       {len(v.corrupt_keys):,} objects of {v.corrupt_chunks:,} chunks: "
            + ", ".join(v.corrupt_keys[:3])
            + more
        )
    if v.fingerprints:
        lines.append("fingerprints  " + "; ".join(f"{hex_} {n:,}" for hex_, n in v.fingerprints.most_common()))
    if len(v.fingerprints) > 1:
        lines.append(
            f"WARNING       {len(v.fingerprints)} configuration fingerprints under one model name: engines of "
            "different configurations (dtype, layout, revision) share these keys"
        )
    if v.removed is not None:
        failed = f"; {v.remove_failures:,} removals failed" if v.remove_failures else ""
        lines.append(
            f"repaired      removed {v.removed:,} keys (the objects and seals of the corrupt chunks){failed}"
        )
    return lines


def write_png(report: InspectReport, path: Path) -> Path:
    """Two panels: chunks complete / partial / absent, and each node's bytes of complete and partial chunks."""
    from kvpipe.connector.bench.plot import new_figure, save_figure

    c = report.chunks
    figure, (chunks_axes, nodes_axes) = new_figure(2, (10.0, 4.0))
    names = ["complete", "partial", "absent"]
    values = [c.complete, c.partial, c.absent if report.absent_known else 0]
    bars = chunks_axes.bar(names, values, color=["tab:green", "tab:orange", "tab:gray"])
    if not report.absent_known:
        chunks_axes.text(
            bars[2].get_x() + bars[2].get_width() / 2, 0, "unknown\n(needs --run)", ha="center", va="bottom"
        )
    prefix = f" (prefix {report.cache_prefix!r})" if report.cache_prefix else ""
    chunks_axes.set_title(f"{c.total:,} chunks of {report.model!r}{prefix}")
    chunks_axes.set_ylabel("chunks")
    chunks_axes.grid(True, axis="y", alpha=0.3)
    labels = [node.segment or node.endpoint or "(not in memory)" for node in report.nodes]
    unit, scale = _unit(max((node.bytes for node in report.nodes), default=0))
    complete = [node.complete_bytes / scale for node in report.nodes]
    partial = [node.partial_bytes / scale for node in report.nodes]
    other = [(node.bytes - node.complete_bytes - node.partial_bytes) / scale for node in report.nodes]
    nodes_axes.bar(labels, complete, label="complete chunks", color="tab:green")
    nodes_axes.bar(labels, partial, bottom=complete, label="partial chunks", color="tab:orange")
    nodes_axes.bar(
        labels,
        other,
        bottom=[a + b for a, b in zip(complete, partial, strict=True)],
        label="unexpected",
        color="tab:purple",
    )
    nodes_axes.set_title(f"bytes per store node (partial/live {report.partial_ratio:.1%})")
    nodes_axes.set_ylabel(unit)
    nodes_axes.tick_params(axis="x", labelrotation=20)
    nodes_axes.grid(True, axis="y", alpha=0.3)
    nodes_axes.legend()
    return save_figure(figure, path)
