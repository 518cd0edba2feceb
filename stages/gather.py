"""The ``gather`` stage: turn an object's scattered buffers into one staged buffer.

Between ``filter`` and ``put``: only objects that will really be sent are
copied. Whether an object is gathered is decided per object:

``never``
    Pass everything as it is (the engine's buffers go to the store).
``always``
    Gather every object that fits a slot.
``auto`` (default)
    When the store's puts cross a network (its ``local_transfers`` is False),
    gather an object of two or more buffers whose buffers average fewer than
    ``below_bytes``: there the per-buffer cost of a transfer outweighs one extra
    memory copy (``kvpipe bench tcp`` measures both ways; BENCHMARKS.md has the
    figures). Large per-layer buffers go as they are, because copying them would
    only double the memory traffic; and nothing is gathered for a local store,
    whose puts are copies already: gathering first only adds one.

A gathered record keeps its engine buffers (observers still learn where the
object came from) and gains ``staging``, a slot of the bounded
:class:`~.staging.StagingPool` that ``put`` sends instead and releases when
its call returns. An entry whose objects are all staged is emitted as
``released``: its job tells the engine that the blocks may be reused while the
put is still in flight.
While every slot is held the stage waits, so a slow store slows gathering
instead of growing memory. An entry with more objects to gather than the pool
has slots for in one round (half the pool) sends the rest ungathered rather
than wait for itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

from kvpipe.pipeline.stage import BatchEntry, BatchStage

from .model import KVCache, Records, StoreObject
from .staging import StagingPool, StagingSlot, gather_into_slots
from .store import SavingStore

log = structlog.get_logger(__name__)

KiB = 1024
MiB = 1024 * KiB
#: objects copied per round (one copy call): about 10 ms of copying at most
ROUND_OBJECTS = 128
#: the first round of a batch: its objects reach the put after ~1 ms of copying
FIRST_ROUND_OBJECTS = 16


class GatherParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "always", "never"] = "auto"
    pool_bytes: int = Field(64 * MiB, gt=0)
    below_bytes: int = Field(64 * KiB, gt=0)
    #: take each gathered object's checksum as it is copied, for the put's seals
    checksum: bool = False


def largest_object(kv: KVCache) -> int:
    """The size of the largest object any shard's layouts can produce: the slot size."""
    return max((layout.object_size for shard in kv.shards for layout in shard.layouts.values()), default=0)


class GatherStage(BatchStage):
    """Records -> the same records, those worth it gathered into one staging buffer each."""

    input_type: ClassVar[Any] = Records
    output_types: ClassVar[dict[str, Any]] = {"out": Records}

    def __init__(self, params: GatherParams, kv: KVCache, store: SavingStore) -> None:
        self._mode = "never" if params.mode == "auto" and store.local_transfers else params.mode
        self._checksums = params.checksum
        self._below_bytes = params.below_bytes
        slot_bytes = largest_object(kv)
        slots = max(2, params.pool_bytes // slot_bytes) if slot_bytes else 0
        self._pool = StagingPool(store, slots, slot_bytes) if slots else None
        # Half the pool per round at most, so one round's objects are put while the
        # next is copied; and short rounds, so the first put starts early.
        self._round_limit = max(1, min(slots // 2, ROUND_OBJECTS))

    # Read-only where the base's attribute is settable: it follows from the params and the store.
    @property
    def passes_through(self) -> bool:  # type: ignore[override]
        return self._pool is None or self._mode == "never"

    @property
    def pool(self) -> StagingPool | None:
        return self._pool

    def worth_gathering(self, record: StoreObject) -> bool:
        if self._pool is None or record.size > self._pool.slot_bytes or record.staging is not None:
            return False
        if record.layers is not None:  # its bytes are not there yet: they come layer by layer
            return False
        if self._mode == "always":
            return True
        count = len(record.buffers)
        return self._mode == "auto" and count >= 2 and record.size < self._below_bytes * count

    async def process_batch(self, batch: Sequence[BatchEntry[Records]]) -> None:
        if self.passes_through:  # the runtime skips it; called directly, it forwards
            for entry in batch:
                await entry.emit(entry.item)
            return
        # Rounds of at most half the slots: a round never waits on itself, and one
        # round's objects can be in the put while the next round is copied. Rounds
        # start small and double, so the first put of a burst starts early.
        round_: list[tuple[BatchEntry[Records], list[int]]] = []
        wanted = 0
        limit = min(FIRST_ROUND_OBJECTS, self._round_limit)
        for entry in batch:
            chosen = [i for i, record in enumerate(entry.item) if self.worth_gathering(record)]
            chosen = chosen[: self._round_limit]
            if round_ and wanted + len(chosen) > limit:
                await self._gather_round(round_)
                round_, wanted = [], 0
                limit = min(2 * limit, self._round_limit)
            round_.append((entry, chosen))
            wanted += len(chosen)
        if round_:
            await self._gather_round(round_)

    async def _gather_round(self, round_: list[tuple[BatchEntry[Records], list[int]]]) -> None:
        todo = [(entry, i) for entry, chosen in round_ for i in chosen]
        staged: dict[tuple[int, int], StoreObject] = {}
        gather_failed = False
        if todo:
            assert self._pool is not None
            records = [entry.item[i] for entry, i in todo]
            slots: list[StagingSlot] = []
            try:
                if not self._pool.allocated:
                    await self.run_blocking(self._pool.allocate)
                slots = await self._pool.acquire_run(len(todo))
                await self.run_blocking(gather_into_slots, records, slots, self._checksums)
            except Exception as error:  # the engine's buffers are still good: send those
                for slot in slots:
                    slot.release()
                gather_failed = True
                log.warning("gathering failed; objects go ungathered", error=str(error))
            else:
                for (entry, i), record, slot in zip(todo, records, slots, strict=True):
                    staged[(id(entry), i)] = _staged(record, slot)
        for entry, _chosen in round_:
            item = tuple(staged.get((id(entry), i), record) for i, record in enumerate(entry.item))
            if gather_failed:
                entry.emit.count("gather_failed")
            # Once every object is in staging the engine's blocks are free to reuse,
            # though the put has not even started.
            await entry.emit(item, released=all(record.staging is not None for record in item))

    async def stop(self) -> None:
        pool = self._pool
        if pool is not None and pool.allocated and pool.free == pool.slots:
            await self.run_blocking(pool.close)  # held slots keep it registered: a put may still read them


def _staged(record: StoreObject, slot: StagingSlot) -> StoreObject:
    return replace(record, staging=slot)
