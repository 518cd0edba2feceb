"""The ``lookup`` stage: how much of a request's prefix can the store give back?

The engine asks this once per waiting request, before it allocates blocks. The
answer is a prefix length in tokens, and a prefix is only worth something if
the whole of it can be loaded: a chunk counts when its object exists for EVERY
storable group and EVERY shard (rank), and counting stops at the first chunk
that does not, because a later chunk without the earlier ones is useless.

Chunks are named exactly as the save path names them (:mod:`.chunks`): chunk
``i`` of a group with ``block_size`` tokens is keyed by the hash of its last hash
block. With groups of different block sizes a prefix can only end where every
group's chunk ends, so hits are whole *prefix units*: the least common multiple
of the storable groups' block sizes (one block for the usual single-size cache).

A recurrent group (mamba, :func:`~.chunks.is_recurrent`) needs no run of chunks:
its chunk ``i`` is the whole state after ``(i+1) * block_size`` tokens. So a hit
of ``L`` tokens needs every other group's chunks up to ``L`` and, of each
recurrent group, the one state at ``L``; the hit is the longest such ``L``, as in
vLLM's own prefix cache and its connector.

The arithmetic is pure (:func:`lookup_keys`, :func:`longest_stored_prefix`) and
shared by the stage and its tests; the stage adds one ``batch_is_exist`` per
batch, across requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from kvpipe.pipeline.stage import BatchEntry, BatchStage, Emit, Stage

from .batch_calls import StoreCallError, call_per_key
from .chunks import chunk_hash_at, is_recurrent
from .keys import object_key
from .model import KVCache, Shard, StoreGroup
from .projection import storable_groups
from .store import EXISTS, LoadingStore


@dataclass(frozen=True, slots=True)
class LookupRequest:
    """How many tokens of this request can the store give back?

    ``block_hashes`` are the engine's chained hashes (one per complete hash
    block); ``num_tokens`` is the request's length; ``num_computed_tokens`` is
    what the engine already has locally. Chunks wholly below it are taken as
    present and not asked for.
    """

    request_id: str
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    num_computed_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(
                f"LookupRequest {self.request_id!r}: num_tokens must be >= 0, got {self.num_tokens}"
            )
        if self.num_computed_tokens < 0:
            raise ValueError(
                f"LookupRequest {self.request_id!r}: num_computed_tokens must be >= 0, "
                f"got {self.num_computed_tokens}"
            )


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The stored prefix of a request, counted from token 0.

    ``hit_tokens`` is a whole number of prefix units (``chunks`` of them) and is
    always below the request's ``num_tokens``: the engine must compute at least
    the last token itself. Callers subtract what they already have locally.
    """

    request_id: str
    hit_tokens: int
    chunks: int


def prefix_unit(groups: Sequence[StoreGroup]) -> int:
    """The tokens a hit grows by: the lcm of the storable groups' block sizes."""
    return math.lcm(*(group.spec.block_size for group in groups))


def _grain(groups: Sequence[StoreGroup], alignment: int | None) -> int:
    """What a hit grows by: ``alignment`` where the engine allows partial hits, else a prefix unit."""
    return alignment or prefix_unit(groups)


def _hit_limit(hash_block_size: int, request: LookupRequest, grain: int) -> int:
    """The longest hit the request allows: hashed, below ``num_tokens``, whole grains."""
    longest = min(request.num_tokens - 1, len(request.block_hashes) * hash_block_size)
    return max(0, longest // grain * grain)


def _ends(
    groups: Sequence[StoreGroup],
    shards: Sequence[Shard],
    hash_block_size: int,
    request: LookupRequest,
    grain: int,
) -> list[tuple[StoreGroup, dict[int, tuple[str, ...] | None]]]:
    """Per group, the token ends that matter up to the limit and their keys (None: the engine's own).

    An object is keyed by the hash at its end: a full chunk at its block's end, a
    partial tail or a recurrent state at the hash block it stops after. A
    non-recurrent group needs its block ends (and, where a hit may end inside a
    block, the tail at that end); a recurrent group only the state where a hit ends.
    """
    limit = _hit_limit(hash_block_size, request, grain)
    per_group = []
    for group in groups:
        block_size = group.spec.block_size
        ends = set(range(grain, limit + 1, grain))
        if not is_recurrent(group):
            ends = {end for end in ends if end % block_size} | set(range(block_size, limit + 1, block_size))
        keys: dict[int, tuple[str, ...] | None] = {}
        for end in sorted(ends):
            if end <= request.num_computed_tokens:
                keys[end] = None  # the engine has it already
                continue
            chunk_hash = chunk_hash_at(request.block_hashes, end, hash_block_size)
            keys[end] = tuple(object_key(shard.namespace, group.store_group, chunk_hash) for shard in shards)
        per_group.append((group, keys))
    return per_group


def lookup_keys(
    groups: Sequence[StoreGroup],
    shards: Sequence[Shard],
    hash_block_size: int,
    request: LookupRequest,
    alignment: int | None = None,
) -> tuple[str, ...]:
    """The keys whose existence decides ``request``'s hit, in prefix order, each once."""
    grain = _grain(groups, alignment)
    ends = [
        (end, index, key)
        for index, (_, keys) in enumerate(_ends(groups, shards, hash_block_size, request, grain))
        for end, chunk in keys.items()
        if chunk is not None
        for key in chunk
    ]
    return tuple(dict.fromkeys(key for _, _, key in sorted(ends, key=lambda item: item[:2])))


def longest_stored_prefix(
    groups: Sequence[StoreGroup],
    shards: Sequence[Shard],
    hash_block_size: int,
    request: LookupRequest,
    exists: Mapping[str, bool],
    alignment: int | None = None,
) -> int:
    """The tokens, from 0, that the store and the engine together hold for every group and shard.

    ``exists`` answers for the keys of :func:`lookup_keys`; a key it does not
    hold counts as missing, and what lies wholly below ``num_computed_tokens``
    counts as present (the engine has it). A hit of ``L`` tokens (a whole number
    of grains: ``alignment``, or a prefix unit) needs, of every non-recurrent
    group, every chunk up to its last block end within ``L`` and, when ``L``
    ends inside a block, the tail stored at ``L``; of every recurrent group, the
    state at ``L``. The hit is the longest such ``L``; it never reaches ``num_tokens``.
    """
    grain = _grain(groups, alignment)
    limit = _hit_limit(hash_block_size, request, grain)
    present: list[tuple[StoreGroup, dict[int, bool], int]] = []
    for group, keys in _ends(groups, shards, hash_block_size, request, grain):
        stored = {
            end: chunk is None or all(exists.get(key, False) for key in chunk) for end, chunk in keys.items()
        }
        run = 0  # the end of the group's run of whole chunks from token 0
        while stored.get(run + group.spec.block_size, False):
            run += group.spec.block_size
        present.append((group, stored, run))

    def holds(hit: int) -> bool:
        for group, stored, run in present:
            if is_recurrent(group):
                if not stored[hit]:
                    return False
            elif hit // group.spec.block_size * group.spec.block_size > run or (
                hit % group.spec.block_size and not stored[hit]
            ):
                return False
        return True

    for hit in range(limit, 0, -grain):
        if hit <= request.num_computed_tokens or holds(hit):
            return hit
    return 0


class LookupStage(BatchStage):
    """LookupRequest -> LookupResult on ``out``, one ``batch_is_exist`` per batch.

    A store error is "don't know", and for a lookup "don't know" is a miss: the
    chunk ends the hit, the request still gets an answer, and the job counts the
    keys under ``exist_errors``. Loading a chunk we are unsure of would cost a
    failed load; missing it costs only recomputation. Each job also counts its
    answer (``hit_tokens``, ``hit_chunks``), so a caller awaiting the job has it.
    """

    input_type: ClassVar[Any] = LookupRequest
    output_types: ClassVar[dict[str, Any]] = {"out": LookupResult}

    def __init__(self, kv: KVCache, store: LoadingStore) -> None:
        self._groups = storable_groups(kv)
        self._unit = prefix_unit(self._groups)
        self._alignment = kv.hit_alignment
        self._shards = kv.shards
        self._hash_block_size = kv.hash_block_size
        self._store = store

    async def process_batch(self, batch: Sequence[BatchEntry[LookupRequest]]) -> None:
        wanted = [
            lookup_keys(self._groups, self._shards, self._hash_block_size, entry.item, self._alignment)
            for entry in batch
        ]
        # Requests sharing a prefix share keys: each key is asked once.
        keys = list(dict.fromkeys(key for entry_keys in wanted for key in entry_keys))
        answers: dict[str, int] = {}
        if keys:
            try:
                answers = dict(
                    zip(keys, await call_per_key(self, self._store.batch_is_exist, keys), strict=True)
                )
            except StoreCallError:
                answers = {}  # no usable answer: every key is unknown, so every chunk is a miss
        for entry, entry_keys in zip(batch, wanted, strict=True):
            request = entry.item
            unknown = sum(1 for key in entry_keys if answers.get(key, -1) not in (EXISTS, 0))
            if unknown:
                entry.emit.count("exist_errors", unknown)
            exists = {key: answers.get(key) == EXISTS for key in entry_keys}
            tokens = longest_stored_prefix(
                self._groups, self._shards, self._hash_block_size, request, exists, self._alignment
            )
            result = LookupResult(request.request_id, tokens, tokens // self._unit)
            entry.emit.count("hit_tokens", result.hit_tokens)
            entry.emit.count("hit_chunks", result.chunks)
            await entry.emit(result)


class LookupObserver(Protocol):
    """Told every lookup's result; must be quick (it runs on the pipeline's loop)."""

    def __call__(self, result: LookupResult) -> None: ...


class LookupResultsStage(Stage):
    """The end of a lookup graph: hands each result to an optional observer.

    A graph needs every port read, and ``lookup`` keeps its ``out`` port so it
    stays composable (a later stage could, say, prefetch the hit). The answer
    already rides on the job's counts; the observer is for callers that want
    the :class:`LookupResult` itself as it arrives.
    """

    ports: ClassVar[tuple[str, ...]] = ()
    input_type: ClassVar[Any] = LookupResult

    def __init__(self, observer: LookupObserver | None = None) -> None:
        self._observer = observer

    async def process(self, item: LookupResult, emit: Emit) -> None:
        if self._observer is not None:
            self._observer(item)
        emit.succeed()
