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
from .chunks import is_recurrent
from .keys import object_key
from .model import KVCache, Shard, StoreGroup
from .projection import storable_groups
from .store import ObjectStore

EXISTS = 1


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


def _hit_limit(groups: Sequence[StoreGroup], hash_block_size: int, request: LookupRequest) -> int:
    """The longest hit the request allows: hashed, below ``num_tokens``, whole units."""
    unit = prefix_unit(groups)
    longest = min(request.num_tokens - 1, len(request.block_hashes) * hash_block_size)
    return max(0, longest // unit * unit)


def _chunk_keys(
    groups: Sequence[StoreGroup], shards: Sequence[Shard], hash_block_size: int, request: LookupRequest
) -> list[tuple[StoreGroup, list[tuple[str, ...] | None]]]:
    """Per group, per chunk up to the limit: its keys (one per shard), or None if local."""
    limit = _hit_limit(groups, hash_block_size, request)
    per_group = []
    for group in groups:
        block_size = group.spec.block_size
        hashes_per_chunk = block_size // hash_block_size
        chunks: list[tuple[str, ...] | None] = []
        for index in range(limit // block_size):
            if (index + 1) * block_size <= request.num_computed_tokens:
                chunks.append(None)  # the engine has it already
                continue
            chunk_hash = request.block_hashes[(index + 1) * hashes_per_chunk - 1]
            chunks.append(
                tuple(object_key(shard.namespace, group.store_group, chunk_hash) for shard in shards)
            )
        per_group.append((group, chunks))
    return per_group


def lookup_keys(
    groups: Sequence[StoreGroup], shards: Sequence[Shard], hash_block_size: int, request: LookupRequest
) -> tuple[str, ...]:
    """The keys whose existence decides ``request``'s hit, in prefix order, each once."""
    keys = (
        key
        for _, chunks in _chunk_keys(groups, shards, hash_block_size, request)
        for chunk in chunks
        if chunk is not None
        for key in chunk
    )
    return tuple(dict.fromkeys(keys))


def longest_stored_prefix(
    groups: Sequence[StoreGroup],
    shards: Sequence[Shard],
    hash_block_size: int,
    request: LookupRequest,
    exists: Mapping[str, bool],
) -> int:
    """The tokens, from 0, that the store and the engine together hold for every group and shard.

    ``exists`` answers for the keys of :func:`lookup_keys`; a key it does not
    hold counts as missing. Chunks wholly below ``num_computed_tokens`` count as
    present (the engine has them). Each group's run of complete chunks stops at
    its first incomplete chunk, and the hit is the longest whole number of prefix
    units within every run at which every recurrent group has its state (a
    prefix held by the engine counts as having it). It never reaches ``num_tokens``.
    """
    unit = prefix_unit(groups)
    prefix = _hit_limit(groups, hash_block_size, request)
    states: list[tuple[StoreGroup, list[bool]]] = []
    for group, chunks in _chunk_keys(groups, shards, hash_block_size, request):
        stored = [keys is None or all(exists.get(key, False) for key in keys) for keys in chunks]
        if is_recurrent(group):
            states.append((group, stored))
            continue
        present = stored.index(False) if False in stored else len(stored)
        prefix = min(prefix, present * group.spec.block_size)
    hit = prefix // unit * unit
    while hit > request.num_computed_tokens and not all(
        stored[hit // group.spec.block_size - 1] for group, stored in states
    ):
        hit -= unit
    return hit


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

    def __init__(self, kv: KVCache, store: ObjectStore) -> None:
        self._groups = storable_groups(kv)
        self._unit = prefix_unit(self._groups)
        self._shards = kv.shards
        self._hash_block_size = kv.hash_block_size
        self._store = store

    async def process_batch(self, batch: Sequence[BatchEntry[LookupRequest]]) -> None:
        wanted = [
            lookup_keys(self._groups, self._shards, self._hash_block_size, entry.item) for entry in batch
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
            tokens = longest_stored_prefix(self._groups, self._shards, self._hash_block_size, request, exists)
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
