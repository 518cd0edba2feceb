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

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol, TypeAlias, TypeVar, dataclass_transform, overload

_Record = TypeVar("_Record")


@dataclass_transform(frozen_default=True)
def hot_record(cls: type[_Record]) -> type[_Record]:
    """A frozen dataclass to the type checker, a plain slotted one at run time.

    For the records made per request or per object at every step (a
    :class:`StoreObject` per chunk per rank): a frozen dataclass's ``__init__``
    sets each field through ``object.__setattr__``, and building a StoreObject
    took 1.45 us that way against 0.23 us plainly, the largest single cost of
    turning a request into records. mypy (strict, on every package) refuses an
    assignment to a field of a ``hot_record`` as it would a frozen one's;
    equality, hashing and :func:`dataclasses.replace` are those of a frozen
    dataclass.
    """
    return dataclass(slots=True, unsafe_hash=True)(cls)


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

    ``sliding_window`` (tokens, the engine's retained tail included) and
    ``attention_chunk`` (chunked local attention) say how far back the group's
    attention reads; 0 is all the way (:func:`~.chunks.unread_tokens` is the rule).
    """

    kind: GroupKind
    block_size: int
    prefix_cacheable: bool = True
    mamba_mode: str | None = None
    sliding_window: int = 0
    attention_chunk: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window < 0 or self.attention_chunk < 0:
            raise ValueError(
                f"GroupSpec: sliding_window and attention_chunk must be >= 0, "
                f"got {self.sliding_window} and {self.attention_chunk}"
            )


class Buffer(NamedTuple):
    """A span of process memory: what the store copies from or into."""

    address: int
    size: int


@dataclass(frozen=True, slots=True)
class Region:
    """An array of equal blocks, e.g. one layer's K/V cache tensor.

    Block ``b``'s bytes are ``bytes_per_block`` from ``base + b * step``. The step
    is the block size (``block_stride`` 0) unless the region is a slice of wider
    blocks: some KV heads of each block (a TP-sharded store object), or one
    object among several side by side in a staging slot.
    """

    base: int
    bytes_per_block: int
    block_stride: int = 0

    @property
    def step(self) -> int:
        """Bytes from one block's start to the next's."""
        return self.block_stride or self.bytes_per_block


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """How a block id of one KV-cache group becomes buffers: one per region.

    The object of a block is its bytes in every region, concatenated in region
    order (layer order for a per-layer cache), which is the value layout vLLM's
    MooncakeStoreConnector uses, so the two read each other's objects.
    """

    regions: tuple[Region, ...]
    object_size: int = field(init=False, compare=False, repr=False)
    sizes: tuple[int, ...] = field(init=False, compare=False, repr=False)
    _hash: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(r.bytes_per_block for r in self.regions))
        object.__setattr__(self, "object_size", sum(self.sizes))
        object.__setattr__(self, "_hash", hash(self.regions))

    def __hash__(self) -> int:
        # Computed once: a save groups its records by layout, and hashing a 64-layer
        # layout anew (64 regions) cost ~20 us a record, a fifth of a TCP save's time.
        return self._hash

    def buffers(self, block_id: int) -> BlockBuffers:
        return BlockBuffers(self, block_id)


class BlockBuffers(Sequence[Buffer]):
    """The buffers of one block in every region of its layout, made when read.

    A model with 64 layers gives 64 buffers per object; making them all for
    every object costs more than the rest of a save's bookkeeping, and objects
    that are gathered (or found stored) never need them one by one. The layout
    and block id say the same in two fields, and let a gather compute every
    address of a batch at once.
    """

    __slots__ = ("layout", "block_id")

    def __init__(self, layout: BlockLayout, block_id: int) -> None:
        self.layout = layout
        self.block_id = block_id

    def __len__(self) -> int:
        return len(self.layout.regions)

    @overload
    def __getitem__(self, index: int) -> Buffer: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Buffer, ...]: ...

    def __getitem__(self, index: int | slice) -> Buffer | tuple[Buffer, ...]:
        if isinstance(index, slice):
            return tuple(self)[index]
        region = self.layout.regions[index]
        return Buffer(region.base + self.block_id * region.step, region.bytes_per_block)

    def addresses(self) -> list[int]:
        block_id = self.block_id
        return [region.base + block_id * region.step for region in self.layout.regions]

    def __iter__(self) -> Iterator[Buffer]:
        return map(Buffer, self.addresses(), self.layout.sizes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockBuffers):
            return self.block_id == other.block_id and self.layout == other.layout
        if isinstance(other, Sequence):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"BlockBuffers(block_id={self.block_id}, regions={len(self)})"


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """What makes one rank's object keys distinct: model, deployment prefix, store format, ranks.

    ``store_namespace`` names a store format other than one object per engine rank
    (e.g. ``@store_tp:4@store_pp:1@store_format:tp_shared_lbhnc``: objects of a
    common store TP size that engines of several TP sizes share); empty for the
    rank-local format. ``tp_rank`` is then the store shard, not the engine's rank.
    """

    model: str
    cache_prefix: str = ""
    tp_rank: int = 0
    pcp_rank: int = 0
    dcp_rank: int = 0
    pp_rank: int = 0
    store_namespace: str = ""


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's part of the cache: its key namespace and its block layouts.

    ``layouts`` is keyed by ENGINE group index; groups that are never stored need
    no layout.
    """

    namespace: KeyNamespace
    layouts: Mapping[int, BlockLayout]


#: (offset, size) byte ranges of an object that one layer is the first of the forward to read
Wave: TypeAlias = tuple[tuple[int, int], ...]
#: per engine group, one wave per layer in the order the forward runs them (:mod:`.layers`)
LayerWaves: TypeAlias = Mapping[int, tuple[Wave, ...]]


class LayerProgress(Protocol):
    """A layer-wise save's objects as the engine computes them (:mod:`.layers`).

    ``waves[i]`` are the byte ranges of each object that layer ``i`` of the
    forward completes; :meth:`wait` ``(i)`` says when they may be read, and
    ``wait(len(waves))`` whether the step ended well (its objects may become
    visible). A step that failed (a load its request computed over failed in it)
    answers False from then on: nothing of it may be stored.
    """

    @property
    def waves(self) -> tuple[Wave, ...]: ...

    def wait(self, step: int, timeout_s: float) -> bool:
        """Until step ``step`` is done (True), or the save is called off or ``timeout_s`` passed (False)."""
        ...


@dataclass(frozen=True, slots=True)
class KVCache:
    """Everything the save stages need to know of the engine's cache.

    ``hit_alignment`` is the grain a prefix hit may end on: by default a whole
    prefix unit (the lcm of the storable groups' block sizes); an engine that
    allows partial hits (vLLM with a hash block below the block size) sets it to
    a multiple of ``hash_block_size``, and a hit may then end inside a block.
    """

    groups: tuple[GroupSpec, ...]
    hash_block_size: int
    shards: tuple[Shard, ...]
    hit_alignment: int | None = None
    #: what else decides the objects' bytes, as the engine knows it (dtypes, per-layer
    #: block shapes, layout, revision): (name, text) pairs, part of the seals' fingerprint
    byte_facts: tuple[tuple[str, str], ...] = ()
    #: the layers' byte ranges of an object, for layer-wise loads (:mod:`.layers`); empty:
    #: the engine's layers are unknown here, and every load reads whole objects
    layer_waves: LayerWaves = field(default_factory=dict)


@hot_record
class SaveRequest:
    """One request's progress, as the engine reports it at a step.

    ``block_hashes`` are the engine's chained hashes, one per complete hash block
    (``KVCache.hash_block_size`` tokens); ``block_ids[g]`` are the blocks of
    engine group ``g`` in token order. Chunks below ``num_saved_tokens`` were
    handed to the pipeline before and are not offered again. ``finished``: no
    later save covers more of the request's hashed prefix, so its partial tail
    is due now. ``state_tokens`` is where the engine's recurrent (mamba) state
    stands, when it is not ``num_computed_tokens`` (a save that stops short of
    the step's end): a state is saved only where it really is.
    ``reused_chunks``: the chunks requests keep asking for (a chunk's hash is its
    last hash block's), each with how many requests asked: stored soft-pinned
    as the budget allows (:mod:`.retention`). ``handoff``: another engine waits
    for these chunks (a prefill handing its request to a decode engine): they are
    never shed to spare a slow store. ``layers``: its objects are written layer by
    layer as the forward computes them (:class:`LayerProgress`), and become
    visible only once the step has ended well.
    """

    request_id: str
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[tuple[int, ...], ...]
    num_computed_tokens: int
    num_saved_tokens: int = 0
    finished: bool = False
    state_tokens: int | None = None
    reused_chunks: Mapping[bytes, int] = field(default_factory=dict)
    handoff: bool = False
    layers: LayerProgress | None = None

    @property
    def state_end(self) -> int:
        """The tokens the recurrent state in the engine's blocks has seen."""
        return self.num_computed_tokens if self.state_tokens is None else self.state_tokens


@dataclass(frozen=True, slots=True)
class StoreGroup:
    """A storable group after projection: its store number and its engine index."""

    store_group: int
    engine_group: int
    spec: GroupSpec


@hot_record
class ProjectedRequest:
    """A request restricted to the storable groups, as ``project`` emits it."""

    request: SaveRequest
    groups: tuple[StoreGroup, ...]


class StagedCopy(Protocol):
    """A contiguous copy of an object's bytes (a staging slot), held until its put returns."""

    @property
    def address(self) -> int: ...

    @property
    def checksum(self) -> int | None:
        """The copy's checksum (:func:`.integrity.checksum`), taken as it was copied; None if not taken."""

    def release(self) -> None: ...


@hot_record
class StoreObject:
    """One store object: everything about it in one immutable record.

    ``buffers`` always say where the object lives in the engine's cache.
    ``staging`` is set once the object was gathered into one contiguous copy:
    the put sends that (:attr:`transfer_buffers`) and then releases it.
    """

    key: str
    chunk_hash: bytes
    store_group: int
    buffers: Sequence[Buffer]
    group_id: str | None = None
    request_id: str = field(default="", compare=False)
    #: its chunk's block in its store group (:attr:`.chunks.Chunk.block_index`): which of a
    #: request's objects one seal may vouch for (:func:`.integrity.seal_spans`)
    chunk_index: int = field(default=0, compare=False)
    staging: StagedCopy | None = field(default=None, compare=False, repr=False)
    #: requests that asked for its chunk, when they keep asking (0: not reused): put it soft-pinned
    #: if the budget allows (:mod:`.retention`)
    reuse: int = field(default=0, compare=False)
    #: another engine waits for it (:attr:`SaveRequest.handoff`): never shed by the slow-store throttle
    handoff: bool = field(default=False, compare=False)
    #: written layer by layer as the forward computes them (:attr:`SaveRequest.layers`)
    layers: LayerProgress | None = field(default=None, compare=False, repr=False)
    #: when it was made (``time.monotonic()``): before the filter asked whether its key is stored, so
    #: a put of its key since may have made that answer stale (:mod:`.stored_lately`)
    made_at: float = field(default_factory=time.monotonic, compare=False)

    @property
    def size(self) -> int:
        if isinstance(self.buffers, BlockBuffers):
            return self.buffers.layout.object_size
        return sum(b.size for b in self.buffers)

    def transfer_spans(self) -> tuple[Sequence[int], Sequence[int]]:
        """(addresses, sizes) of :attr:`transfer_buffers`, as the store's batch calls take them."""
        if self.staging is not None:
            return [self.staging.address], [self.size]
        return spans(self.buffers)

    @property
    def transfer_count(self) -> int:
        """``len(transfer_buffers)``, without making them (the put's budget counts it per record)."""
        return 1 if self.staging is not None else len(self.buffers)

    @property
    def transfer_buffers(self) -> Sequence[Buffer]:
        """What a put reads: the staged copy if there is one, else the engine's buffers."""
        if self.staging is not None:
            return (Buffer(self.staging.address, self.size),)
        return self.buffers


def spans(buffers: Sequence[Buffer]) -> tuple[Sequence[int], Sequence[int]]:
    """(addresses, sizes) of ``buffers``; for a block, without making a Buffer per region."""
    if isinstance(buffers, BlockBuffers):
        return buffers.addresses(), buffers.layout.sizes
    return [buffer.address for buffer in buffers], [buffer.size for buffer in buffers]


#: What flows between the collect, group_ids, filter and put stages: the records
#: of one request produced at one step.
Records = Sequence[StoreObject]
