"""After a run: is what the store holds intact, and are chunks whole?

``verify`` reads back every object the pipeline stored or found and compares it
with the bytes its block must hold (a pure function of the object's prefix hash,
rank and group, see :mod:`.synthetic`). An object that is gone (evicted) is
``missing``, not a mismatch; a mismatch is data corruption and must be zero.

``count_chunks`` asks, for every logical chunk the pipeline considered (one chunk
hash: every stored group and rank of one prefix chunk, i.e. one group id), how
many of its objects exist: all (complete), some (partial) or none (absent). With
group semantics, eviction takes chunks whole, so partial should stay at zero.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpipe.connector.store.protocol import Store
from kvpipe.stages import EXISTS, ObjectStatus, StoreObject

from .synthetic import SyntheticCache

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

#: Objects read per verification call (bounded scratch memory).
READ_BATCH_BYTES = 32 << 20
EXIST_BATCH = 1024


@dataclass(frozen=True)
class Verification:
    checked: int = 0
    mismatches: int = 0
    missing: int = 0


@dataclass(frozen=True)
class ChunkCounts:
    total: int = 0
    complete: int = 0
    partial: int = 0
    absent: int = 0


def verify(store: Store, cache: SyntheticCache, records: Iterable[StoreObject]) -> Verification:
    checked = mismatches = missing = 0
    for batch in _batches_by_bytes(list(records), READ_BATCH_BYTES):
        scratch = torch.empty(sum(r.size for r in batch), dtype=torch.uint8)
        store.register_buffer(scratch.data_ptr(), scratch.nbytes)
        try:
            offsets = [0]
            for record in batch[:-1]:
                offsets.append(offsets[-1] + record.size)
            results = store.batch_get_into_multi_buffers(
                [r.key for r in batch],
                [[scratch.data_ptr() + offset] for offset in offsets],
                [[r.size] for r in batch],
            )
            for record, offset, result in zip(batch, offsets, results, strict=True):
                checked += 1
                if result < 0:
                    missing += 1
                    continue
                rank, engine_group = cache.locate(record.buffers[0].address)
                expected = cache.object_bytes(rank, engine_group, record.chunk_hash)
                read = ctypes.string_at(scratch.data_ptr() + offset, record.size)
                if result != record.size or read != ctypes.string_at(expected.data_ptr(), expected.nbytes):
                    mismatches += 1  # (torch.equal is ~300x slower than memcmp on these byte tensors)
        finally:
            store.unregister_buffer(scratch.data_ptr())
    return Verification(checked, mismatches, missing)


def count_chunks(store: Store, records: Iterable[StoreObject]) -> ChunkCounts:
    by_chunk: dict[bytes, list[str]] = {}
    for record in records:
        by_chunk.setdefault(record.chunk_hash, []).append(record.key)
    keys = [key for chunk_keys in by_chunk.values() for key in chunk_keys]
    present: dict[str, bool] = {}
    for start in range(0, len(keys), EXIST_BATCH):
        batch = keys[start : start + EXIST_BATCH]
        present.update(zip(batch, (answer == EXISTS for answer in store.batch_is_exist(batch)), strict=True))
    complete = partial = absent = 0
    for chunk_keys in by_chunk.values():
        found = sum(present[key] for key in chunk_keys)
        if found == len(chunk_keys):
            complete += 1
        elif found:
            partial += 1
        else:
            absent += 1
    return ChunkCounts(len(by_chunk), complete, partial, absent)


def final_statuses(
    observed: Iterable[tuple[StoreObject, ObjectStatus]],
) -> dict[str, tuple[StoreObject, ObjectStatus]]:
    """One status per key over all requests that offered it: put, else existing, else not stored."""
    rank = {ObjectStatus.PUT: 2, ObjectStatus.EXISTING: 1, ObjectStatus.FAILED: 0, ObjectStatus.THROTTLED: 0}
    final: dict[str, tuple[StoreObject, ObjectStatus]] = {}
    for record, status in observed:
        if record.key not in final or rank[status] > rank[final[record.key][1]]:
            final[record.key] = (record, status)
    return final


def _batches_by_bytes(records: Sequence[StoreObject], limit: int) -> Iterable[list[StoreObject]]:
    batch: list[StoreObject] = []
    used = 0
    for record in records:
        if batch and used + record.size > limit:
            yield batch
            batch, used = [], 0
        batch.append(record)
        used += record.size
    if batch:
        yield batch
