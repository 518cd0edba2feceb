"""The ``project`` stage: restrict a request to the storable groups and route it.

It is the save path's entry: it decides, with the same arithmetic the collect
stages use, whether a request has complete chunks to save (port ``full``) and,
once finished, a partial tail (port ``tail``), so requests with nothing new cost
no further stage any work.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvpipe.pipeline.stage import Emit, Stage

from .chunks import full_chunk_range, tail_chunks
from .model import KVCache, ProjectedRequest, SaveRequest
from .storable import storable_groups

FULL_PORT = "full"
TAIL_PORT = "tail"


class ProjectStage(Stage):
    """SaveRequest -> ProjectedRequest on ``full`` and/or ``tail``, or a drop."""

    fuses = True  # pure computation: it may run inline in its producer's task

    ports: ClassVar[tuple[str, ...]] = (FULL_PORT, TAIL_PORT)
    input_type: ClassVar[Any] = SaveRequest
    output_types: ClassVar[dict[str, Any]] = {FULL_PORT: ProjectedRequest, TAIL_PORT: ProjectedRequest}

    def __init__(self, kv: KVCache) -> None:
        self._groups = storable_groups(kv)
        self._engine_groups = len(kv.groups)
        self._hash_block_size = kv.hash_block_size

    async def process(self, item: SaveRequest, emit: Emit) -> None:
        if len(item.block_ids) != self._engine_groups:
            raise ValueError(
                f"request {item.request_id!r} has block ids for {len(item.block_ids)} engine groups, "
                f"the KV cache has {self._engine_groups}"
            )
        groups = self._groups
        hash_block_size = self._hash_block_size
        # Loops rather than any() over generators: this runs once per request and step.
        full = False
        for group in groups:
            if full_chunk_range(item, group, hash_block_size):
                full = True
                break
        tail = False
        if item.finished:
            for group in groups:
                if tail_chunks(item, group, hash_block_size):
                    tail = True
                    break
        if not (full or tail):
            emit.drop("nothing to save")
            return
        projected = ProjectedRequest(item, groups)
        if full:
            await emit(projected, FULL_PORT)
        if tail:
            await emit(projected, TAIL_PORT)
