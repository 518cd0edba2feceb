"""The KV data model of the save path: what the engine has and what the store gets.

Engine side: a cache is a list of :class:`GroupSpec` (one per KV-cache group, in the
engine's order), each group's blocks laid out in memory as a :class:`BlockLayout`,
per rank :class:`Shard`. A :class:`SaveRequest` is one request's progress.

Store side: a :class:`StoreObject` is ONE record per store object. Its key, group
id, chunk hash and buffers travel together through every stage, so no stage can
pair a key with another object's group id or addresses; the parallel lists the
store API wants are built from records inside the put call and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple


class GroupKind(StrEnum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    RING_BUFFER = "ring_buffer"
    MAMBA = "mamba"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A KV-cache group as the engine has it.

    ``prefix_cacheable`` is the engine's own verdict: a ring or scratch buffer
    (e.g. a QSA ring) can be transferred but a prefix of it cannot be reused, so
    it is never stored. ``mamba_mode`` matters for mamba groups only: their state
    is reusable at block boundaries only in ``"align"`` mode.
    """

    kind: GroupKind
    block_size: int
    prefix_cacheable: bool = True
    mamba_mode: str | None = None


class Buffer(NamedTuple):
    """A span of process memory: what the store copies from or into."""

    address: int
    size: int


@dataclass(frozen=True, slots=True)
class Region:
    """A contiguous array of equal blocks, e.g. one layer's K/V cache tensor."""

    base: int
    bytes_per_block: int


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """How a block id of one KV-cache group becomes buffers: one per region.

    The object of a block is its bytes in every region, concatenated in region
    order (layer order for a per-layer cache), which is the value layout vLLM's
    MooncakeStoreConnector uses, so the two read each other's objects.
    """

    regions: tuple[Region, ...]

    def buffers(self, block_id: int) -> tuple[Buffer, ...]:
        return tuple(Buffer(r.base + block_id * r.bytes_per_block, r.bytes_per_block) for r in self.regions)

    @property
    def object_size(self) -> int:
        return sum(r.bytes_per_block for r in self.regions)


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """What makes one rank's object keys distinct: model, deployment prefix, ranks."""

    model: str
    cache_prefix: str = ""
    tp_rank: int = 0
    pcp_rank: int = 0
    dcp_rank: int = 0
    pp_rank: int = 0


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's part of the cache: its key namespace and its block layouts.

    ``layouts`` is keyed by ENGINE group index; groups that are never stored need
    no layout.
    """

    namespace: KeyNamespace
    layouts: Mapping[int, BlockLayout]


@dataclass(frozen=True, slots=True)
class KVCache:
    """Everything the save stages need to know of the engine's cache."""

    groups: tuple[GroupSpec, ...]
    hash_block_size: int
    shards: tuple[Shard, ...]


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """One request's progress, as the engine reports it at a step.

    ``block_hashes`` are the engine's chained hashes, one per complete hash block
    (``KVCache.hash_block_size`` tokens); ``block_ids[g]`` are the blocks of
    engine group ``g`` in token order. Chunks below ``num_saved_tokens`` were
    handed to the pipeline before and are not offered again.
    """

    request_id: str
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[tuple[int, ...], ...]
    num_computed_tokens: int
    num_saved_tokens: int = 0
    finished: bool = False


@dataclass(frozen=True, slots=True)
class StoreGroup:
    """A storable group after projection: its store number and its engine index."""

    store_group: int
    engine_group: int
    spec: GroupSpec


@dataclass(frozen=True, slots=True)
class ProjectedRequest:
    """A request restricted to the storable groups, as ``project`` emits it."""

    request: SaveRequest
    groups: tuple[StoreGroup, ...]


@dataclass(frozen=True, slots=True)
class StoreObject:
    """One store object: everything about it in one immutable record."""

    key: str
    chunk_hash: bytes
    store_group: int
    buffers: tuple[Buffer, ...]
    group_id: str | None = None
    request_id: str = field(default="", compare=False)

    @property
    def size(self) -> int:
        return sum(b.size for b in self.buffers)


#: What flows between the collect, group_ids, filter and put stages: the records
#: of one request produced at one step.
Records = Sequence[StoreObject]
