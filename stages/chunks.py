"""What a chunk is, the hash that names it, and which chunks of a request are due for saving.

A chunk is one block of one storable group (``block_size`` tokens). The engine
hashes tokens at a finer grain (``hash_block_size``, a divisor of every block
size), and hashes chain, so a chunk is named by the hash of its LAST hash block:
that hash identifies the whole prefix up to the chunk's end. vLLM names chunks the
same way, which keeps the two connectors' objects interchangeable.
(:func:`chunk_hash_at` is that rule; saves, lookups, loads and KV events all name
chunks with it.)

A recurrent group (mamba) is different: its block holds the state after a number
of tokens, not those tokens' keys and values, and the engine keeps a state only
where a step ended (vLLM's ``align`` mode schedules prefill chunks to end on block
boundaries, and frees older states soon after). So a mamba group's only chunk is
the state where the engine's state stands (``SaveRequest.state_end``) when that is
a block boundary: the state after chunk ``i`` in the block the engine lists for
chunk ``i``; where the engine hashes finer than its blocks, a state at a hash-block
boundary inside a block is the group's tail. Earlier entries of its block table are
placeholders (vLLM's null block), never saved.
(:func:`is_recurrent` names the rule; lookups and loads follow it too.)

A group whose attention reads a window (sliding window, chunked local attention)
needs, for a prefix of ``L`` tokens, only the blocks that attention past ``L``
reads: the engine frees the blocks wholly below (vLLM puts its null block in their
place), so they are neither loaded nor needed for a hit.
(:func:`first_read_block` names the rule; lookups and loads follow it.)

These functions are pure and shared by ``project`` (is there anything to save?)
and the collect stages (what exactly?), so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .model import GroupKind, GroupSpec, SaveRequest, StoreGroup


def is_recurrent(group: StoreGroup) -> bool:
    """Whether ``group``'s chunk is a state at its end (mamba), not the keys and values of its tokens."""
    return group.spec.kind is GroupKind.MAMBA


def read_reach(spec: GroupSpec) -> int | None:
    """The most tokens before a position that the group's attention reads; None: the whole prefix.

    A sliding window of ``W`` reads the last ``W - 1`` tokens; chunked local
    attention reads back to the start of the position's chunk, at most ``C - 1``.
    """
    if spec.sliding_window:
        return spec.sliding_window - 1
    if spec.attention_chunk:
        return spec.attention_chunk - 1
    return None


def unread_tokens(spec: GroupSpec, tokens: int) -> int:
    """How many of the first ``tokens`` tokens attention past them never reads again (0 for full attention).

    The engine's own rule (vLLM's ``get_num_skipped_tokens``) over :func:`read_reach`:
    a window's reach counts back from the end, a local chunk starts on a multiple of
    its size.
    """
    reach = read_reach(spec)
    if reach is None:
        return 0
    if spec.sliding_window:
        return max(0, tokens - reach)
    return tokens // spec.attention_chunk * spec.attention_chunk


def reads_window(spec: GroupSpec) -> bool:
    """Whether the group's attention reads a window rather than the whole prefix (:func:`read_reach`)."""
    return read_reach(spec) is not None


def whole_prefix(group: StoreGroup) -> bool:
    """Whether ``group``'s attention reads every token before a position: neither a window nor a state.

    Such a group's tail (its tokens up to a hash block inside a block) holds every
    shorter prefix of its block too, so any tail of a block can serve a hit that
    ends before it in that block.
    """
    return not (is_recurrent(group) or reads_window(group.spec))


def first_read_block(group: StoreGroup, tokens: int) -> int:
    """The first of ``group``'s blocks that a prefix of ``tokens`` tokens needs (0 unless it reads a window)."""
    return unread_tokens(group.spec, tokens) // group.spec.block_size


def chunk_hash_at(block_hashes: Sequence[bytes], tokens_end: int, hash_block_size: int) -> bytes:
    """The hash that names the chunk (whole block, tail or state) that ends at token ``tokens_end``.

    Hashes chain, so the hash of the last hash block before ``tokens_end`` names
    the whole prefix up to it. ``tokens_end`` must be a positive multiple of
    ``hash_block_size`` within the hashes given (IndexError past them).
    """
    return block_hashes[tokens_end // hash_block_size - 1]


class Chunk(NamedTuple):
    """One block of one storable group to save, and the hash that names it.

    ``tokens_end`` is how far into the request the chunk's hash reaches; sorting by
    it puts a request's earlier prefix first, which is the part worth most. (A
    named tuple: one is made per chunk per step, and it is the cheapest record.)
    """

    group: StoreGroup
    chunk_hash: bytes
    block_id: int
    tokens_end: int

    @property
    def block_index(self) -> int:
        """The block of its group the chunk lies in: its tokens are within ``[index*bs, (index+1)*bs)``."""
        return (self.tokens_end - 1) // self.group.spec.block_size

    @property
    def tokens_start(self) -> int:
        """The first token of the chunk's block (a tail starts there too)."""
        return self.block_index * self.group.spec.block_size


def full_chunk_range(request: SaveRequest, group: StoreGroup, hash_block_size: int) -> range:
    """The indexes of the complete chunks of ``group`` not saved yet.

    Chunk ``i`` covers tokens ``[i*bs, (i+1)*bs)``. It is due when it is computed,
    not wholly below ``num_saved_tokens``, its last hash block is hashed and its
    block id is known; the range stops at the first chunk lacking any of these, as
    a later chunk is useless to a reader without the earlier ones.

    A recurrent group's range is at most the one chunk whose state the engine
    holds: the one ending at ``num_computed_tokens`` (see the module docstring).
    """
    block_size = group.spec.block_size
    end = min(
        request.num_computed_tokens // block_size,
        len(request.block_hashes) // (block_size // hash_block_size),
        len(request.block_ids[group.engine_group]),
    )
    start = request.num_saved_tokens // block_size
    if is_recurrent(group):
        state = request.state_end
        at_state = state % block_size == 0 and end == state // block_size
        start = max(start, end - 1) if at_state else end
    return range(start, max(start, end))


def full_chunks(request: SaveRequest, group: StoreGroup, hash_block_size: int) -> tuple[Chunk, ...]:
    """The complete chunks of ``group`` not saved yet (:func:`full_chunk_range`), in token order."""
    block_size = group.spec.block_size
    block_ids = request.block_ids[group.engine_group]
    hashes = request.block_hashes
    return tuple(
        Chunk(group, chunk_hash_at(hashes, end, hash_block_size), block_ids[index], end)
        for index in full_chunk_range(request, group, hash_block_size)
        for end in ((index + 1) * block_size,)
    )


def tail_chunks(request: SaveRequest, group: StoreGroup, hash_block_size: int) -> tuple[Chunk, ...]:
    """A finished request's partial tail of ``group``, if it has one (at most one chunk).

    The tail is the hashed tokens after the last complete chunk: from
    ``(computed // bs) * bs`` to ``(computed // hbs) * hbs``. It is named by its
    last complete hash block and stored as the whole block holding it, as vLLM
    does. A tail already below ``num_saved_tokens`` is not offered again. With
    ``hash_block_size == block_size`` there is never a tail. A recurrent group's
    tail is its state, and only where the state really is: at a hash-block
    boundary inside a block (a block boundary is a full chunk).
    """
    if not request.finished:
        return ()
    block_size = group.spec.block_size
    computed = request.num_computed_tokens
    hashed_blocks = computed // hash_block_size
    start = (computed // block_size) * block_size
    end = hashed_blocks * hash_block_size
    block_index = computed // block_size
    if is_recurrent(group) and (end != computed or request.state_end != computed):
        return ()
    block_ids = request.block_ids[group.engine_group]
    if (
        end <= max(start, request.num_saved_tokens)
        or hashed_blocks > len(request.block_hashes)
        or block_index >= len(block_ids)
    ):
        return ()
    return (
        Chunk(
            group=group,
            chunk_hash=chunk_hash_at(request.block_hashes, end, hash_block_size),
            block_id=block_ids[block_index],
            tokens_end=end,
        ),
    )


def chunks_to_save(request: SaveRequest, groups: Sequence[StoreGroup], hash_block_size: int) -> list[Chunk]:
    """Every chunk a save stores: each group's complete chunks, then its tail, groups in order.

    What a worker stages and what the scheduler announces once stored: one list,
    so the two cannot disagree on a chunk.
    """
    return [
        chunk
        for group in groups
        for chunk in (
            *full_chunks(request, group, hash_block_size),
            *tail_chunks(request, group, hash_block_size),
        )
    ]
