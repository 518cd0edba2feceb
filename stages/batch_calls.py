"""What the stages that call the store share: calls within the buffer budget, per-key store calls, and removal.

A store call carries at most :data:`MAX_BUFFERS_PER_CALL` buffers, puts and gets
alike, so the put and load stages cut their batches into calls by buffer count
(:func:`split_into_calls`), keeping each chunk's objects in one call.

A batch call answers per key. When it answers nothing usable (it raised, or gave
a result list of the wrong length) there is no way to know which answer belongs to
which object, so every record of the call fails; pairing results by position
with the wrong keys would be worse than failing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpipe.pipeline.stage import AnyStage

from .model import StoreObject
from .store import LoadingStore, SavingStore

#: The buffer budget of one store call (puts and gets alike): the transport refuses a
#: call with more than about 2048 buffers to one peer, and may keep failing after.
MAX_BUFFERS_PER_CALL = 2048


class StoreCallError(Exception):
    """A batch store call gave no usable per-key answer; the message says why."""


def split_into_calls(
    records: Sequence[StoreObject], max_buffers: int, extra_per_record: int = 0
) -> list[list[StoreObject]]:
    """Runs of ``records`` whose buffer counts each sum to at most ``max_buffers``.

    A record counts its :attr:`~.model.StoreObject.transfer_count` plus
    ``extra_per_record`` (a load's seal, read in the same call).

    The objects of one chunk (one lifecycle group: every store group and shard of
    the same prefix) go into the same call whenever they fit the budget together,
    so a call boundary never leaves one half of a chunk stored and the other
    refused. Chunks keep the order of their first record. Every record must fit
    the budget on its own (the caller fails those that don't).
    """

    def cost(record: StoreObject) -> int:
        return record.transfer_count + extra_per_record

    if sum(map(cost, records)) <= max_buffers:
        return [list(records)] if records else []  # one call: every chunk is whole in it
    chunks: dict[bytes, list[StoreObject]] = {}
    for record in records:
        chunks.setdefault(record.chunk_hash, []).append(record)
    calls: list[list[StoreObject]] = []
    current: list[StoreObject] = []
    used = 0

    def add(unit: list[StoreObject], buffers: int) -> None:
        nonlocal current, used
        if current and used + buffers > max_buffers:
            calls.append(current)
            current, used = [], 0
        current.extend(unit)
        used += buffers

    for unit in chunks.values():
        unit_buffers = sum(map(cost, unit))
        if unit_buffers <= max_buffers:
            add(unit, unit_buffers)
        else:  # too big to keep together: fill calls record by record
            for record in unit:
                add([record], cost(record))
    if current:
        calls.append(current)
    return calls


async def call_per_key(
    stage: AnyStage, fn: Callable[..., Sequence[int]], keys: Sequence[str], *rest: Any
) -> list[int]:
    """Run ``fn(keys, *rest)`` in the stage's worker thread; one result per key, or StoreCallError."""
    try:
        results = await stage.run_blocking(fn, keys, *rest)
    except Exception as error:  # a store is outside our control: fail its records, not the pipeline
        raise StoreCallError(f"store call raised {type(error).__name__}: {error}") from error
    if len(results) != len(keys):
        raise StoreCallError(f"store answered {len(results)} results for {len(keys)} keys")
    return list(results)


def sizes_of(keys: Sequence[str], store: LoadingStore) -> list[int]:
    """Each of ``keys``' stored size (blocking; per key bytes or negative)."""
    return [store.get_size(key) for key in keys]


def remove_each(keys: Sequence[str], store: SavingStore | LoadingStore, force: bool) -> list[int]:
    """Remove each of ``keys`` (blocking; per key 0 or negative); unless ``force``, not a leased one.

    ``force`` only for objects no reader can use (a torn chunk's, a damaged one's): a
    lookup's ``batch_is_exist`` leases what it finds, so a hot chunk's objects may
    stay leased for as long as it is hot, and an unforced remove would leave them.
    Unforced for what a reader may still want (a demoted pin: a lease means a load
    is about to read it).
    """
    return [store.remove(key, force=force) for key in keys]
