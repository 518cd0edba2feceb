"""The ``full`` and ``tail`` stages: turn a projected request into store records.

Both make one :class:`StoreObject` per chunk per shard, each carrying its own
key, chunk hash and buffers; they differ only in which chunks they take
(:mod:`.chunks`). Records are ordered by how far into the request their chunk
reaches, so when a later put is refused the earlier, more reusable prefix has
already been sent.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kvpipe.pipeline.stage import Emit, Stage

from .chunks import Chunk, full_chunks, tail_chunks
from .keys import object_key_prefix
from .model import (
    BlockBuffers,
    BlockLayout,
    KVCache,
    LayerProgress,
    ProjectedRequest,
    Records,
    SaveRequest,
    Shard,
    StoreGroup,
    StoreObject,
)
from .storable import storable_groups


class RecordMaker:
    """Makes the records of one KV cache's chunks: one per chunk per shard.

    What a record shares with every other of its (shard, store group), the key
    prefix and the block layout, is found once, when the maker is made, not once
    per request: a save makes records for every request at every step, and
    finding these again was most of a record's cost.
    """

    def __init__(self, shards: Sequence[Shard], groups: Sequence[StoreGroup]) -> None:
        """``groups``: the cache's storable groups (with one, a request's chunks never need sorting)."""
        self._groups_interleave = len(groups) > 1
        #: per store group: (key prefix, layout) per shard
        self._targets: dict[int, list[tuple[str, BlockLayout]]] = {
            group.store_group: [
                (object_key_prefix(shard.namespace, group.store_group), shard.layouts[group.engine_group])
                for shard in shards
            ]
            for group in groups
        }

    def records(
        self,
        chunks: Sequence[Chunk],
        request_id: str,
        reused_chunks: Mapping[bytes, int] | None = None,
        handoff: bool = False,
        layers: LayerProgress | None = None,
    ) -> tuple[StoreObject, ...]:
        """One record per chunk per shard, earliest prefix first, each with its chunk's ``reused_chunks`` count.

        ``handoff`` and ``layers``: the request's (:class:`~.model.SaveRequest`), carried by each record.
        """
        # Groups interleave by prefix length. (One chunk needs no sorting: the common case.)
        if self._groups_interleave and len(chunks) > 1 and len({chunk.group.store_group for chunk in chunks}) > 1:
            chunks = sorted(chunks, key=lambda chunk: (chunk.tokens_end, chunk.group.store_group))
        all_targets = self._targets
        made_at = time.monotonic()
        records: list[StoreObject] = []
        append = records.append
        for chunk in chunks:
            group, chunk_hash, block_id, _ = chunk
            store_group = group.store_group
            targets = all_targets[store_group]
            hex_hash = chunk_hash.hex()
            reuse = reused_chunks.get(chunk_hash, 0) if reused_chunks else 0
            block_index = chunk.block_index
            for prefix, layout in targets:
                append(
                    StoreObject(
                        prefix + hex_hash,
                        chunk_hash,
                        store_group,
                        BlockBuffers(layout, block_id),
                        None,
                        request_id,
                        block_index,
                        None,
                        reuse,
                        handoff,
                        layers,
                        made_at,
                    )
                )
        return tuple(records)


class _CollectStage(Stage):
    """ProjectedRequest -> the tuple of its records on ``out`` (or a drop if none)."""

    fuses = True  # pure computation: it may run inline in its producer's task

    input_type: ClassVar[Any] = ProjectedRequest
    output_types: ClassVar[dict[str, Any]] = {"out": Records}

    def __init__(self, kv: KVCache) -> None:
        # storable_groups refuses at build time a cache whose shards lack a layout
        self._records = RecordMaker(kv.shards, storable_groups(kv))
        self._hash_block_size = kv.hash_block_size

    async def process(self, item: ProjectedRequest, emit: Emit) -> None:
        request = item.request
        groups = item.groups
        if len(groups) == 1:  # the common case, without a list of one group's chunks
            chunks: Sequence[Chunk] = self._chunks(request, groups[0])
        else:
            chunks = [chunk for group in groups for chunk in self._chunks(request, group)]
        records = self._records.records(
            chunks, request.request_id, request.reused_chunks, request.handoff, request.layers
        )
        if not records:
            emit.drop("no chunk to save")
            return
        emit.count("considered", len(records))
        await emit(records)

    def _chunks(self, request: SaveRequest, group: StoreGroup) -> tuple[Chunk, ...]:
        """The chunks of ``group`` this path saves."""
        raise NotImplementedError


class FullChunksStage(_CollectStage):
    """Records of the complete chunks not saved yet."""

    def _chunks(self, request: SaveRequest, group: StoreGroup) -> tuple[Chunk, ...]:
        return full_chunks(request, group, self._hash_block_size)


class TailStage(_CollectStage):
    """Records of a finished request's partial tail."""

    def _chunks(self, request: SaveRequest, group: StoreGroup) -> tuple[Chunk, ...]:
        return tail_chunks(request, group, self._hash_block_size)
