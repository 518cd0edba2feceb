"""Load planning: which chunks a load reads, into which engine blocks, and how many slots it takes.

A :class:`LoadRequest` names a token range the lookup found stored and the blocks
the engine allocated for it. Planning turns it into :class:`LoadChunk` s, one per
chunk of every storable group the range touches (:func:`load_chunks`), counts them
without making them (:func:`load_slots`, :func:`longest_load`: what a load takes
through staging), and names the blocks a request that cannot be planned fails
(:func:`touched_block_ids`). It is pure arithmetic over the cache's groups: no
store, no buffers, no records.

It is apart from the :mod:`.load` stage because more than the stage plans loads:
the vLLM scheduler sizes loads by their slots before any is sent, the worker places
a load's chunks in its staging area, and the KV events name the chunks a load
brought back, none of which runs the stage (or should import it, with its store
calls and integrity checks). The stage turns each planned chunk into one record
per shard (:func:`.load.load_targets`) and reads them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .chunks import chunk_hash_at, first_read_block, is_recurrent, read_reach, whole_prefix
from .model import StoreGroup


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """Load the chunks covering tokens ``[start_tokens, end_tokens)`` into these blocks.

    ``block_ids[g]`` are the blocks of ENGINE group ``g`` in token order from token
    0 (as the engine lists them), so chunk ``i`` of a group lands in its
    ``block_ids[g][i]``. Both bounds must fall on a chunk boundary of every
    storable group: the engine's local hit and the lookup's hit always do.

    ``tail_ends``: (store group, end) where the object the lookup found for the
    block ``end_tokens`` cuts ends, if not at ``end_tokens``: a tail further into
    that block, or the whole block, holds its first tokens too
    (:meth:`.lookup.LookupPlan.cut_block_sources`). Only an end inside that
    block, of a group that reads the whole prefix, is used; the rest load the
    tail at ``end_tokens``.

    ``layered``: its objects are read wave by wave in the forward's layer order
    (:mod:`.layers`), and the load stage tells each wave's arrival
    (:class:`~.load.LayerObserver`), so the engine computes a layer as soon as
    its bytes are in; the objects are still judged whole before the load settles.
    """

    request_id: str
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[tuple[int, ...], ...]
    start_tokens: int
    end_tokens: int
    tail_ends: tuple[tuple[int, int], ...] = ()
    #: read layer by layer (:mod:`.layers`), each layer's arrival told as it lands
    layered: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.start_tokens <= self.end_tokens:
            raise ValueError(
                f"LoadRequest {self.request_id!r}: need 0 <= start_tokens <= end_tokens, "
                f"got start_tokens={self.start_tokens}, end_tokens={self.end_tokens}"
            )


class LoadChunk(NamedTuple):
    """One chunk a load fills: its group, its index in the group, its hash and its engine block."""

    group: StoreGroup
    block_index: int  # the chunk's block in its group, as :attr:`.chunks.Chunk.block_index`
    chunk_hash: bytes
    block_id: int


def load_chunks(
    groups: Sequence[StoreGroup], hash_block_size: int, request: LoadRequest
) -> tuple[LoadChunk, ...]:
    """The chunks of ``[start_tokens, end_tokens)``, every storable group, earliest prefix first.

    ``end_tokens`` may end inside a block (a partial hit): that block is loaded
    from the tail stored at ``end_tokens`` (or the object ``tail_ends`` names in
    that block, for a group that reads the whole prefix), whole, and the engine
    recomputes the tokens past it. A recurrent group (mamba) has one chunk: its state at
    ``end_tokens``, into the block the engine lists for the range's last chunk.
    A group that reads a window (sliding window) has the blocks attention past
    ``end_tokens`` reads (:func:`~.chunks.first_read_block`): the engine lists
    its null block for the others.
    A request that does not fit the cache (bounds off a block or hash-block
    boundary, too few hashes or block ids) is a ValueError naming what is wrong;
    nothing of it is loaded.
    """
    start, end = request.start_tokens, request.end_tokens
    engine_groups = 1 + max(group.engine_group for group in groups)
    if len(request.block_ids) < engine_groups:
        raise ValueError(
            f"load {request.request_id!r}: block ids for {len(request.block_ids)} engine groups, "
            f"storable engine group {engine_groups - 1} needs {engine_groups}"
        )
    if end > len(request.block_hashes) * hash_block_size:
        raise ValueError(
            f"load {request.request_id!r}: end_tokens {end} is beyond the "
            f"{len(request.block_hashes)} hash blocks of {hash_block_size} tokens given"
        )
    if end % hash_block_size:
        raise ValueError(
            f"load {request.request_id!r}: end_tokens {end} is not a multiple of hash_block_size {hash_block_size}"
        )
    tail_ends = dict(request.tail_ends)
    for store_group, tail in tail_ends.items():
        if tail % hash_block_size or tail > len(request.block_hashes) * hash_block_size:
            raise ValueError(
                f"load {request.request_id!r}: tail_ends[{store_group}] {tail} is not a multiple of "
                f"hash_block_size {hash_block_size} within the {len(request.block_hashes)} hash blocks given"
            )
    chunks: list[tuple[int, int, LoadChunk]] = []
    for group in groups:
        block_size = group.spec.block_size
        if start % block_size and not is_recurrent(group):
            raise ValueError(
                f"load {request.request_id!r}: start_tokens {start} is not a multiple of block_size "
                f"{block_size} of engine group {group.engine_group}"
            )
        block_ids = request.block_ids[group.engine_group]
        needed = -(-end // block_size)
        if len(block_ids) < needed:
            raise ValueError(
                f"load {request.request_id!r}: engine group {group.engine_group} has "
                f"{len(block_ids)} block ids, tokens up to {end} need {needed}"
            )
        # (chunk index, tokens at its end): whole chunks, then a tail ending inside a block
        first = _first_loaded(group, start, end)
        ends = [(index, (index + 1) * block_size) for index in range(first, end // block_size)]
        if end % block_size:
            source = tail_ends.get(group.store_group, end)
            if not (end < source <= (end // block_size + 1) * block_size and whole_prefix(group)):
                source = end  # the tail at the end itself
            ends.append((end // block_size, source))
        if is_recurrent(group):
            ends = ends[-1:]  # one state: the one at the end of the range
        for index, tokens_end in ends:
            chunk_hash = chunk_hash_at(request.block_hashes, tokens_end, hash_block_size)
            chunks.append(
                (tokens_end, group.store_group, LoadChunk(group, index, chunk_hash, block_ids[index]))
            )
    chunks.sort(key=lambda chunk: chunk[:2])
    return tuple(chunk for _, _, chunk in chunks)


def load_slots(groups: Sequence[StoreGroup], start_tokens: int, end_tokens: int) -> int:
    """The chunks :func:`load_chunks` makes of ``[start_tokens, end_tokens)``, counted without making them.

    A chunk per block of every non-recurrent group the range touches (of a windowed
    group, from the first block its window reads), one state of each recurrent
    group: what a load through staging takes in slots.
    """
    if end_tokens <= start_tokens:
        return 0
    return sum(
        1
        if is_recurrent(group)
        else -(-end_tokens // group.spec.block_size) - _first_loaded(group, start_tokens, end_tokens)
        for group in groups
    )


def _most_slots(group: StoreGroup) -> int | None:
    """The most slots one load takes of ``group`` whatever its length; None: no bound (full attention).

    Attention reaching ``R`` tokens back (:func:`read_reach`) touches at most
    ``ceil(R / block)`` blocks before the end and the one the end lies in.
    """
    if is_recurrent(group):
        return 1
    reach = read_reach(group.spec)
    return None if reach is None else -(-reach // group.spec.block_size) + 1


def _first_loaded(group: StoreGroup, start_tokens: int, end_tokens: int) -> int:
    """The first block of a non-recurrent group that a load of ``[start_tokens, end_tokens)`` fills."""
    return max(start_tokens // group.spec.block_size, first_read_block(group, end_tokens))


@functools.lru_cache(maxsize=64)  # asked at every lookup, for a few slot counts
def longest_load(groups: tuple[StoreGroup, ...], slots: int) -> int | None:
    """The most tokens one load from a block boundary may span in ``slots`` slots (:func:`load_slots`).

    None: no length outgrows the slots (every group is recurrent or reads a window, and the
    most each can take fits): a load of a long prompt through a sliding window takes a few
    slots however far it reaches.
    """
    bounded = [most for group in groups if (most := _most_slots(group)) is not None]
    if len(bounded) == len(groups) and sum(bounded) <= slots:
        return None
    if all(is_recurrent(group) for group in groups):
        return 0
    widest = max(group.spec.block_size for group in groups)
    fit, past = 0, slots * widest + 1  # fits; does not (a slot holds a block at most)
    while past - fit > 1:
        middle = (fit + past) // 2
        fit, past = (middle, past) if load_slots(groups, 0, middle) <= slots else (fit, middle)
    return fit


def touched_block_ids(groups: Sequence[StoreGroup], request: LoadRequest) -> frozenset[int]:
    """Every block id a request's range names, as far as it names them: what an invalid request fails.

    Only the blocks :func:`load_chunks` would fill: below a window, and before a
    recurrent group's state, the engine lists its null block, which every such
    request shares.
    """
    touched: set[int] = set()
    start, end = request.start_tokens, request.end_tokens
    for group in groups:
        if group.engine_group < len(request.block_ids) and end > start:
            past = -(-end // group.spec.block_size)
            first = past - 1 if is_recurrent(group) else _first_loaded(group, start, end)
            touched.update(request.block_ids[group.engine_group][first:past])
    return frozenset(touched)
