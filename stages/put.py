"""The ``put`` stage: copy the records' buffers into the store (the end of the save path).

Calls are sized by buffer count, not record count: the transport refuses a call
with more than about 2048 buffers to one peer (and may keep failing after), and
each buffer costs tens of microseconds, so the budget is what bounds a call. The
parallel keys/pointers/sizes/group-id lists the API wants are built from the
records of one call, right before it, and never outlive it, so position i of every
list always describes the same object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpipe.pipeline.stage import BatchEntry, BatchStage, Emit

from .backoff import Backoff
from .batch_calls import StoreCallError, call_per_key, fail_record
from .model import Records, StoreObject
from .store import Code, ObjectStore, describe


class PutParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_buffers_per_call: int = Field(2048, gt=0)
    backoff_initial_s: float = Field(0.01, ge=0)
    backoff_max_s: float = Field(0.2, ge=0)

    @model_validator(mode="after")
    def _backoff_grows(self) -> PutParams:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s ({self.backoff_max_s}) must be >= "
                f"backoff_initial_s ({self.backoff_initial_s})"
            )
        return self


def split_into_calls(records: Sequence[StoreObject], max_buffers: int) -> list[list[StoreObject]]:
    """Consecutive runs of ``records`` whose buffer counts each sum to at most ``max_buffers``.

    Every record must fit the budget on its own (the caller fails those that don't).
    """
    calls: list[list[StoreObject]] = []
    current: list[StoreObject] = []
    used = 0
    for record in records:
        if current and used + len(record.buffers) > max_buffers:
            calls.append(current)
            current, used = [], 0
        current.append(record)
        used += len(record.buffers)
    if current:
        calls.append(current)
    return calls


class PutStage(BatchStage):
    """Records -> stored objects. A sink: it emits nothing, it reports per record."""

    ports: ClassVar[tuple[str, ...]] = ()
    input_type: ClassVar[Any] = Records

    def __init__(self, params: PutParams, store: ObjectStore) -> None:
        self._store = store
        self._max_buffers = params.max_buffers_per_call
        self._backoff = Backoff(params.backoff_initial_s, params.backoff_max_s)

    async def process_batch(self, batch: Sequence[BatchEntry[Records]]) -> None:
        holders: dict[str, list[tuple[Emit, StoreObject]]] = {}
        for entry in batch:
            for record in entry.item:
                if len(record.buffers) > self._max_buffers:
                    fail_record(
                        entry.emit,
                        f"put {record.key}: {len(record.buffers)} buffers exceed "
                        f"max_buffers_per_call={self._max_buffers}; not sent",
                    )
                else:
                    holders.setdefault(record.key, []).append((entry.emit, record))
        first_of_each_key = [held[0][1] for held in holders.values()]  # requests sharing a prefix share keys
        for call in split_into_calls(first_of_each_key, self._max_buffers):
            try:
                codes = await self._put(call)
            except StoreCallError as error:
                for record in call:
                    for emit, held in holders[record.key]:
                        fail_record(emit, f"put {held.key}: {error}")
                continue
            for record, code in zip(call, codes, strict=True):
                for emit, held in holders[record.key]:
                    _settle(emit, held, code)

    async def _put(self, call: Sequence[StoreObject]) -> list[int]:
        """One store call for ``call``'s records, after any back-off; per-record codes."""
        await self._backoff.wait()
        config = self._store.new_replicate_config()  # fresh per call: overlapping puts must not share one
        if self._store.supports_group_ids and any(record.group_id for record in call):
            config.group_ids = [record.group_id or "" for record in call]
        keys = [record.key for record in call]
        ptrs = [[buffer.address for buffer in record.buffers] for record in call]
        sizes = [[buffer.size for buffer in record.buffers] for record in call]
        codes = await call_per_key(self, self._store.batch_put_from_multi_buffers, keys, ptrs, sizes, config)
        self._backoff.record(pressured=Code.NO_SPACE in codes)
        return codes


def _settle(emit: Emit, record: StoreObject, code: int) -> None:
    """Report what became of one record, in its own job."""
    if code == Code.OK:
        emit.count("put")
        emit.succeed()
    elif code == Code.ALREADY_EXISTS:  # someone stored it first: the object is there
        emit.count("existing")
        emit.succeed()
    else:
        if code == Code.NO_SPACE:
            emit.count("backpressure")
        fail_record(emit, f"put {record.key}: {describe(code)}")
