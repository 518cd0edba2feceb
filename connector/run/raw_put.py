"""The raw put rate of the run's own objects: what the pipeline's rate is read against.

A run's wall time mixes the pipeline with the workload generator (the engine
stand-in writing synthetic KV bytes into blocks), and the pipeline's rate means
little alone. This puts the same objects (the same buffers and sizes, under keys
of their own) with plain ``batch_put_from_multi_buffers`` calls one after another,
timing the calls only, and removes each batch again at once, so the store never
holds more than one batch extra and the run's own objects stay as they were.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvpipe.connector.store import Store
from kvpipe.stages import StoreObject

#: objects per call: a batch of the size the save stages send
BATCH = 64
SUFFIX = "@kvpipe-raw-put"


@dataclass(frozen=True)
class RawPut:
    seconds: float  # in the put calls
    bytes: int  # of the objects stored
    failed: int  # objects the store refused (a full store: the rate counts the stored only)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def raw_put(store: Store, records: Sequence[StoreObject], batch: int = BATCH) -> RawPut:
    """Put ``records``' bytes again under keys of their own, ``batch`` a call, timed; then remove them."""
    seconds, stored, failed = 0.0, 0, 0
    for start in range(0, len(records), batch):
        chunk = records[start : start + batch]
        keys = [record.key + SUFFIX for record in chunk]
        spans = [record.transfer_spans() for record in chunk]
        ptrs = [list(addresses) for addresses, _ in spans]
        sizes = [list(lengths) for _, lengths in spans]
        config = store.new_replicate_config()
        began = time.perf_counter()
        codes = store.batch_put_from_multi_buffers(keys, ptrs, sizes, config)
        seconds += time.perf_counter() - began
        stored += sum(record.size for record, code in zip(chunk, codes, strict=True) if code == 0)
        failed += sum(1 for code in codes if code != 0)
        for key in keys:
            store.remove(key)
    return RawPut(seconds, stored, failed)
