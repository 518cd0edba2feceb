"""What a run's pipeline figures are read against: the pipeline alone, and raw puts, on the run's own objects.

A run's wall time mixes the pipeline with the workload generator (the engine
stand-in writing synthetic KV bytes into blocks, hashing prompts), which on these
machines takes most of it; the pipeline's rate read off it is the generator's.
After the run, two measurements on the same objects, neither leaving anything in
the store:

- :func:`pipeline_alone`: the run's save requests again, all at once, through the
  same save graph under a cache prefix of their own (so the existence filter
  finds nothing of the run's), from the first submit to the last job's end;
- :func:`raw_put`: the same objects put with plain ``batch_put_from_multi_buffers``
  calls of :data:`BATCH` objects one after another, the calls only timed, each
  batch removed again at once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvpipe.connector.store.protocol import Store
from kvpipe.pipeline import Graph, SyncPipeline
from kvpipe.stages import KVCache, ObjectStatus, SaveRequest, StoreObject
from kvpipe.stages.keys import deployment_key_pattern
from kvpipe.stages.object_status import ObjectObserver

#: objects per call: a batch of the size the save stages send
BATCH = 64
SUFFIX = "@kvpipe-raw-put"
#: the cache prefix the pipeline-alone replay stores under (removed after it)
ALONE_PREFIX = "kvpipe-pipeline-alone"


@dataclass(frozen=True)
class Measured:
    """One timed measurement: its seconds, the bytes it stored, the objects the store refused."""

    seconds: float
    bytes: int
    failed: int  # a full store: the rate counts the stored bytes only

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_report(self) -> dict[str, float | int]:
        return {
            "seconds": round(self.seconds, 3),
            "bytes": self.bytes,
            "gbps": round(self.gbps, 3),
            "failed": self.failed,
        }


def raw_put(store: Store, records: Sequence[StoreObject], batch: int = BATCH) -> Measured:
    """Put ``records``' bytes again under keys of their own, ``batch`` a call, timed; then remove them."""
    seconds, stored, failed = 0.0, 0, 0
    for start in range(0, len(records), batch):
        chunk = records[start : start + batch]
        tag = f"{SUFFIX}-{start}"  # one master call removes the batch again
        keys = [record.key + tag for record in chunk]
        spans = [record.transfer_spans() for record in chunk]
        ptrs = [list(addresses) for addresses, _ in spans]
        sizes = [list(lengths) for _, lengths in spans]
        config = store.new_replicate_config()
        began = time.perf_counter()
        codes = store.batch_put_from_multi_buffers(keys, ptrs, sizes, config)
        seconds += time.perf_counter() - began
        stored += sum(record.size for record, code in zip(chunk, codes, strict=True) if code == 0)
        failed += sum(1 for code in codes if code != 0)
        store.remove_by_regex(f"{re.escape(tag)}$", True)
    return Measured(seconds, stored, failed)


def under_prefix(kv: KVCache, cache_prefix: str) -> KVCache:
    """``kv`` with every rank's keys under ``cache_prefix``: the same memory, other objects."""
    shards = tuple(
        replace(shard, namespace=replace(shard.namespace, cache_prefix=cache_prefix)) for shard in kv.shards
    )
    return replace(kv, shards=shards)


def pipeline_alone(
    make_graph: Callable[[KVCache, ObjectObserver], Graph],
    kv: KVCache,
    store: Store,
    requests: Sequence[SaveRequest],
    queue_capacity: int,
) -> Measured:
    """The save requests through ``make_graph``'s pipeline with nothing else running; then its objects go."""
    alone = under_prefix(kv, ALONE_PREFIX)
    stored: list[int] = []
    failed: list[StoreObject] = []

    def observe(record: StoreObject, status: ObjectStatus) -> None:
        if status is ObjectStatus.PUT:
            stored.append(record.size)
        elif status is ObjectStatus.FAILED:
            failed.append(record)

    pipeline = SyncPipeline(
        make_graph(alone, observe), queue_capacity=queue_capacity, when_full="wait", name="alone"
    )
    with pipeline:
        began = time.perf_counter()
        for request in requests:
            pipeline.submit(request)
        for _ in requests:
            pipeline.next_completed(timeout_s=None)
        seconds = time.perf_counter() - began
    store.remove_by_regex(deployment_key_pattern(alone.shards[0].namespace), True)
    return Measured(seconds, sum(stored), len(failed))
