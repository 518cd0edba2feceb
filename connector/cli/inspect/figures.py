"""What ``kvpipe inspect`` reports: the figures on one model's objects in a store, and their JSON.

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
  config's workload regenerated: :func:`~.replay.expected_objects`; each chunk then has
  exactly the objects the job offers for it, e.g. a mamba state only where the
  engine's state stood).
- ``chunks``: :class:`~kvpipe.connector.run.check.ChunkCounts`, counted by the run report's own
  rule (:func:`~kvpipe.connector.run.check.count_chunks`): complete (every expected object
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
- ``verify`` (``None`` unless asked, :class:`~.verify.Scrub`): the scrubber. A Mooncake
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
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple

from kvpipe.connector.run.check import ChunkCounts

__all__ = ["SCRUB_VERDICTS", "InspectReport", "NodeFigures", "ShardId", "ShardSource", "Verification"]

#: what a verification finds an object to be (the module docstring says what each means)
SCRUB_VERDICTS = ("ok", "corrupt", "unverified", "unreadable")


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
