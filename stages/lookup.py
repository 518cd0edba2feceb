"""Lookups: how much of a request's prefix can the store give back?

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

A group that reads a window (sliding window, :func:`~.chunks.first_read_block`) needs
no run from token 0 either: a hit of ``L`` tokens needs its chunks from the first
block attention past ``L`` reads, as the engine's own prefix cache asks.

A recurrent group (mamba, :func:`~.chunks.is_recurrent`) needs no run of chunks:
its chunk ``i`` is the whole state after ``(i+1) * block_size`` tokens. So a hit
of ``L`` tokens needs every other group's chunks up to ``L`` and, of each
recurrent group, the one state at ``L``; the hit is the longest such ``L``, as in
vLLM's own prefix cache and its connector.

An engine that drafts tokens from its own hidden states (EAGLE, MTP) needs the
hidden states of the last tokens before the first it computes, so it recomputes
the last block of any hit, its own prefix cache's included (vLLM's "EAGLE block
drop"). A hit of ``L`` tokens then also needs, of every non-recurrent group, its
chunks up to ``L`` plus that group's *margin* (:func:`recompute_margin`: a block,
or one grain where hits end inside blocks), which are stored but not loaded: the
hit stops one margin short of what is stored, as the engine's own rule does, so
the store never hands back the block the engine means to recompute. As in vLLM's
rule, groups of several kinds look for that margin past the longest hit the
request allows, while a cache of one kind finds it within that length (so a
prompt stored whole, of whole blocks, hits one block less).

The rule is pure: a :class:`LookupPlan` says which objects decide a hit
(:attr:`~LookupPlan.keys`) and reads the hit off the store's answers for them
(:meth:`~LookupPlan.hit`). The
caller makes the store call (the vLLM connector's scheduler side: one
``batch_is_exist`` per scheduling step, across requests), so a lookup costs no
pipeline hop on the engine's critical path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from .chunks import chunk_hash_at, first_read_block, is_recurrent, reads_window, whole_prefix
from .integrity import seal_candidates
from .keys import key_chunk_hex, object_key_prefix
from .model import Shard, StoreGroup, hot_record


@hot_record
class LookupRequest:
    """How many tokens of this request can the store give back?

    ``block_hashes`` are the engine's chained hashes (one per complete hash
    block); ``num_tokens`` is the request's length; ``num_computed_tokens`` is
    what the engine already has locally. Chunks wholly below it are taken as
    present and not asked for. ``max_load_tokens`` bounds what one load may
    bring past ``num_computed_tokens`` (the loader's staging room): a hit stops
    there rather than become a load that finds no room, and nothing past it is
    asked for.
    """

    request_id: str
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    num_computed_tokens: int = 0
    max_load_tokens: int | None = None

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
        if self.max_load_tokens is not None and self.max_load_tokens < 0:
            raise ValueError(
                f"LookupRequest {self.request_id!r}: max_load_tokens must be >= 0 or None, "
                f"got {self.max_load_tokens}"
            )


def prefix_unit(groups: Sequence[StoreGroup]) -> int:
    """The tokens a hit grows by: the lcm of the storable groups' block sizes."""
    return math.lcm(*(group.spec.block_size for group in groups))


def _grain(groups: Sequence[StoreGroup], alignment: int | None) -> int:
    """What a hit grows by: ``alignment`` where the engine allows partial hits, else a prefix unit."""
    return alignment or prefix_unit(groups)


#: whether a group's chunk ending at a token is there (:meth:`LookupPlan._stored`)
_Stored = Callable[[dict[int, "_Chunk | None"], int], bool]


def recompute_margin(group: StoreGroup, alignment: int | None) -> int:
    """The tokens past a hit an engine that recomputes a hit's last block needs stored in ``group``.

    A block; where hits may end inside blocks (``alignment`` below the block
    size), one grain of a group that reads the whole prefix (vLLM looks those
    up by hash block); none of a recurrent group, whose state at the hit is all
    a hit needs of it.
    """
    if is_recurrent(group):
        return 0
    block_size = group.spec.block_size
    return alignment if alignment and alignment < block_size and whole_prefix(group) else block_size


def _hit_limit(hash_block_size: int, request: LookupRequest, grain: int) -> int:
    """The longest hit the request allows: hashed, below ``num_tokens``, one load long at most, whole grains."""
    longest = min(request.num_tokens - 1, len(request.block_hashes) * hash_block_size)
    if request.max_load_tokens is not None:
        longest = min(longest, request.num_computed_tokens + request.max_load_tokens)
    return max(0, longest // grain * grain)


class _Chunk(NamedTuple):
    """What decides whether one chunk counts: its objects (one per shard) and, sealed, per shard the seals
    any one of which may vouch for its object (:func:`~.integrity.seal_candidates`)."""

    objects: tuple[str, ...]
    seals: tuple[tuple[str, ...], ...] = ()

    def keys(self) -> list[str]:
        return [*self.objects, *(key for candidates in self.seals for key in candidates)]

    def stored(self, exists: Mapping[str, bool]) -> bool:
        return all(exists.get(key, False) for key in self.objects) and all(
            any(exists.get(key, False) for key in candidates) for candidates in self.seals
        )


def _ends(
    groups: Sequence[StoreGroup],
    shards: Sequence[Shard],
    hash_block_size: int,
    request: LookupRequest,
    grain: int,
    sealed: bool,
    margins: Sequence[int],
) -> list[tuple[StoreGroup, dict[int, _Chunk | None]]]:
    """Per group, the token ends that matter up to the limit and their chunks (None: the engine's own).

    An object is keyed by the hash at its end: a full chunk at its block's end, a
    partial tail or a recurrent state at the hash block it stops after. A
    non-recurrent group needs its block ends (and, where a hit may end inside a
    block, the tail at that end), with several kinds of group up to its
    ``margins`` past the limit (hashed tokens only); a recurrent group only the
    state where a hit ends.
    """
    limit = _hit_limit(hash_block_size, request, grain)
    hashed = len(request.block_hashes) * hash_block_size
    past_limit = len({group.spec for group in groups}) > 1
    computed = request.num_computed_tokens
    per_group = []
    for group, margin in zip(groups, margins, strict=True):
        block_size = group.spec.block_size
        ends: Iterable[int] = range(grain, limit + 1, grain)
        if not is_recurrent(group):
            reach = min(limit + margin, hashed) if past_limit else limit
            ends = {end for end in range(grain, reach + 1, grain) if end % block_size} | set(
                range(block_size, reach + 1, block_size)
            )
        # a chunk's keys differ only in their prefix (per shard): made once, not per chunk
        prefixes = [object_key_prefix(shard.namespace, group.store_group) for shard in shards]
        keys: dict[int, _Chunk | None] = {}
        for end in sorted(ends):
            if end <= computed:
                keys[end] = None  # the engine has it already
                continue
            chunk_hash = chunk_hash_at(request.block_hashes, end, hash_block_size)
            hex_hash = chunk_hash.hex()
            objects = tuple([prefix + hex_hash for prefix in prefixes])
            seals = (
                tuple(
                    tuple(
                        seal_candidates(
                            key, chunk_hash, (end - 1) // block_size, block_size, request.block_hashes, hash_block_size
                        )
                    )
                    for key in objects
                )
                if sealed
                else ()
            )
            keys[end] = _Chunk(objects, seals)
        per_group.append((group, keys))
    return per_group


class LookupPlan:
    """One request's lookup, worked out once: the keys to ask (:attr:`keys`) and the hit the answers give (:meth:`hit`).

    Both need every chunk's keys, which cost ~2 us a chunk to make: a lookup on
    the engine's thread makes them once. ``sealed`` (``integrity: required``):
    the seals that may vouch for each object are asked for and needed too, so a
    chunk no seal can vouch for is a miss rather than a load that is refused.
    ``recomputes_last_block``: the engine recomputes the last block of a hit
    (EAGLE, MTP): a hit needs each group's :func:`recompute_margin` stored past it.
    """

    def __init__(
        self,
        groups: Sequence[StoreGroup],
        shards: Sequence[Shard],
        hash_block_size: int,
        request: LookupRequest,
        alignment: int | None = None,
        sealed: bool = False,
        recomputes_last_block: bool = False,
    ) -> None:
        self._request = request
        self._grain = _grain(groups, alignment)
        self._limit = _hit_limit(hash_block_size, request, self._grain)
        self._margins = [recompute_margin(group, alignment) if recomputes_last_block else 0 for group in groups]
        self._ends = _ends(groups, shards, hash_block_size, request, self._grain, sealed, self._margins)

    @property
    def request(self) -> LookupRequest:
        """The lookup this plan answers."""
        return self._request

    @functools.cached_property
    def keys(self) -> tuple[str, ...]:
        """The keys whose existence decides the hit, in prefix order, each once."""
        if len(self._ends) == 1:  # one group: its ends are in order already
            chunks = self._ends[0][1].values()
            return tuple(dict.fromkeys(key for chunk in chunks if chunk is not None for key in chunk.keys()))
        ends = [
            (end, index, key)
            for index, (_, keys) in enumerate(self._ends)
            for end, chunk in keys.items()
            if chunk is not None
            for key in chunk.keys()
        ]
        return tuple(dict.fromkeys(key for _, _, key in sorted(ends, key=lambda item: item[:2])))

    @functools.cached_property
    def chunk_hexes(self) -> frozenset[str]:
        """The chunks its keys name (their hashes, hex), seals' anchors included."""
        return frozenset(key_chunk_hex(key) for key in self.keys)

    def _stored(self, exists: Mapping[str, bool]) -> _Stored:
        """Whether a group's chunk ending at a token is there, by the store's answers ``exists``."""

        def stored(chunks: dict[int, _Chunk | None], end: int) -> bool:
            if end not in chunks:  # past the limit
                return False
            chunk = chunks[end]
            return chunk is None or chunk.stored(exists)

        return stored

    def _reaches(self, stored: _Stored) -> list[int]:
        """Per group, how far from token 0 a whole-prefix group's stored objects cover (0 for the others).

        Its run of whole chunks, then the furthest object stored in the block
        after the run: a tail (the tokens of a block up to a hash block) holds
        every shorter prefix of its block too, so a hit may end anywhere up to it
        and load its cut block from it (:meth:`cut_block_sources`).
        """
        reaches = []
        for group, chunks in self._ends:
            block_size = group.spec.block_size
            reach = 0
            if whole_prefix(group):
                while stored(chunks, reach + block_size):
                    reach += block_size
                if self._grain < block_size:  # hits may end inside a block: its furthest tail
                    run = reach
                    reach = next(
                        (end for end in range(run + block_size - self._grain, run, -self._grain) if stored(chunks, end)),
                        run,
                    )
            reaches.append(reach)
        return reaches

    def hit(self, exists: Mapping[str, bool]) -> int:
        """The tokens, from 0, that the store and the engine together hold for every group and shard.

        ``exists`` answers for :attr:`keys`; a key it does not hold counts as
        missing, and what lies wholly below ``num_computed_tokens`` counts as
        present (the engine has it). A hit of ``L`` tokens (a whole number of
        grains: ``alignment``, or a prefix unit) needs, of every group that reads
        the whole prefix, objects covering the first ``L`` tokens (its chunks up
        to the last block end within ``L`` and, when ``L`` ends inside a block,
        a tail of that block ending at ``L`` or past it); of a group that reads a
        window, the chunks that window reads and the tail at ``L`` where it ends
        inside a block; of every recurrent group, the state at ``L``. Where the
        engine recomputes a hit's last block, the non-recurrent groups need the
        same up to ``L`` plus their margin. The hit is the longest such ``L``;
        it never reaches ``num_tokens``. Sealed, an object counts only with a
        seal that may vouch for it; whether it does, its load tells.

        Chunks are judged only as the answer needs them: a whole-prefix group's
        run of whole chunks from token 0 bounds the hit (past the block after the
        run nothing holds), so a prompt that misses early costs a few chunks, not
        all of them.
        """
        stored = self._stored(exists)
        reaches = self._reaches(stored)
        longest = self._limit
        for (group, _), reach, margin in zip(self._ends, reaches, self._margins, strict=True):
            if whole_prefix(group):
                longest = min(longest, reach - margin)

        def window_holds(group: StoreGroup, chunks: dict[int, _Chunk | None], end: int) -> bool:
            """Whether a windowed group holds what its attention up to ``end`` reads."""
            block_size = group.spec.block_size
            whole = range(first_read_block(group, end) + 1, end // block_size + 1)
            if not all(stored(chunks, index * block_size) for index in whole):
                return False
            return not end % block_size or stored(chunks, end)

        def holds(hit: int) -> bool:
            for (group, chunks), margin in zip(self._ends, self._margins, strict=True):
                if is_recurrent(group):
                    if not stored(chunks, hit):
                        return False
                elif reads_window(group.spec) and not (
                    window_holds(group, chunks, hit) and (not margin or window_holds(group, chunks, hit + margin))
                ):
                    return False
            return True  # whole-prefix groups: the hit is within their reach (``longest``)

        for hit in range(longest // self._grain * self._grain, 0, -self._grain):
            if hit <= self._request.num_computed_tokens or holds(hit):
                return hit
        return 0

    def cut_block_sources(self, exists: Mapping[str, bool], hit: int) -> tuple[tuple[int, int], ...]:
        """Where the objects that hold the blocks ``hit`` cuts end, per store group, where not at ``hit``.

        For :attr:`~.load_plan.LoadRequest.tail_ends`: of each whole-prefix group
        whose block ``hit`` ends inside, its whole block if stored, else the
        furthest tail stored in it (:meth:`_reaches`), when that is not the tail
        at ``hit`` itself. ``hit`` is one :meth:`hit` gave for the same answers.
        """
        sources = []
        for (group, _), reach in zip(self._ends, self._reaches(self._stored(exists)), strict=True):
            block_size = group.spec.block_size
            if whole_prefix(group) and hit % block_size:
                source = min((hit // block_size + 1) * block_size, reach)
                if source > hit:
                    sources.append((group.store_group, source))
        return tuple(sources)

