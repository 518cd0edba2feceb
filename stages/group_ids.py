"""The ``group_ids`` stage: tie each record to its chunk's lifecycle group.

Shared by the full and tail paths. Each record's group id is derived from that
record's OWN chunk hash, right where the record is, so no later filtering or
splitting can pair an object with another chunk's group. When the store has no
group ids the records pass unchanged: saving still works, only whole-chunk
eviction is lost, which is worth one warning, not a failure.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import structlog
from pydantic import BaseModel, ConfigDict

from kvpipe.pipeline.stage import Emit, Stage

from .flags import StrictFlag
from .keys import group_id
from .model import KeyNamespace, KVCache, Records
from .storable import storable_groups
from .store import SavingStore

log = structlog.get_logger(__name__)


class GroupIdsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enable_group_semantics: StrictFlag = False


class GroupIdsStage(Stage):
    """Records -> the same records, with ``group_id`` set when enabled and supported."""

    fuses = True  # pure computation: it may run inline in its producer's task

    input_type: ClassVar[Any] = Records
    output_types: ClassVar[dict[str, Any]] = {"out": Records}

    def __init__(self, params: GroupIdsParams, kv: KVCache, store: SavingStore) -> None:
        storable_groups(kv)  # refuse at build time shards that disagree on model or prefix
        self._namespace: KeyNamespace | None = None
        if not params.enable_group_semantics:
            return
        if not store.supports_group_ids:
            log.warning(
                "group semantics enabled but the store has no group ids; saving without them",
                store=type(store).__name__,
            )
            return
        self._namespace = kv.shards[0].namespace  # ranks aside, every shard's is the same

    # Read-only where the base's attribute is settable: it follows from the params and the store.
    @property
    def passes_through(self) -> bool:  # type: ignore[override]
        return self._namespace is None

    async def process(self, item: Records, emit: Emit) -> None:
        namespace = self._namespace
        if namespace is not None:
            item = tuple(replace(record, group_id=group_id(namespace, record.chunk_hash)) for record in item)
        await emit(item)
