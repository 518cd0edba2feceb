"""What a run's pipeline figures are read against: the pipeline alone, and raw puts, on the run's own objects.

After the run, two measurements of storing the run's distinct objects, like with
like: each under a key namespace of its own, so neither finds, overwrites or
removes the other's objects or the run's:

- :func:`pipeline_alone`: the run's save requests again, all at once, through the
  same save graph under the cache prefix :data:`ALONE_PREFIX`, from the first
  submit to the last job's end (its existence filter skips what it stored itself),
  with no observer: what it stored is asked of the store once the clock stopped;
- :func:`raw_put`: the same objects put once each with plain
  ``batch_put_from_multi_buffers`` calls of :data:`BATCH` objects one after
  another, keys under :data:`RAW_PREFIX`, the whole loop timed.

They take turns, :data:`ROUNDS` timed rounds each after an untimed one, on a
frozen heap, as every ``kvpipe bench`` workload times its contenders (one round of
either moves by tens of percent on a busy machine; a full garbage collection of the
run's own objects landed in every third round). Before each round the
measurement removes its own previous copy, untimed, so each writes into memory
only its own last round freed, while the other's copy stays. The store needs
room for two more copies of the run's objects.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvpipe.connector.store.protocol import Store
from kvpipe.connector.timing import alternate
from kvpipe.pipeline import Graph, SyncPipeline
from kvpipe.stages import EXISTS, KVCache, SaveRequest, StoreObject, storable_groups
from kvpipe.stages.keys import deployment_key_pattern, object_key_prefix
from kvpipe.stages.object_status import ObjectObserver

#: objects per call: a batch of the size the save stages send
BATCH = 64
#: what the raw puts' keys start with (``RAW_PREFIX@`` + the run's key)
RAW_PREFIX = "kvpipe-raw-put"
#: the cache prefix the pipeline-alone replay stores under
ALONE_PREFIX = "kvpipe-pipeline-alone"
#: timed rounds of each measurement (their medians are reported)
ROUNDS = 5


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


@dataclass(frozen=True)
class Baselines:
    alone: Measured
    raw: Measured

    @property
    def ratio(self) -> float | None:
        """The pipeline alone's rate over the raw puts', to 3 places (None if the raw puts stored nothing)."""
        return round(self.alone.gbps / self.raw.gbps, 3) if self.raw.gbps else None


def measure(
    make_graph: Callable[[KVCache, ObjectObserver | None], Graph],
    kv: KVCache,
    store: Store,
    requests: Sequence[SaveRequest],
    objects: Sequence[StoreObject],
    queue_capacity: int,
    rounds: int = ROUNDS,
) -> Baselines:
    """Time the pipeline alone on ``requests`` and raw puts of ``objects`` (the distinct objects they
    store), taking turns for ``rounds`` rounds; their median seconds, with the bytes and failures of
    each one's last round. Both copies are removed at the end, also when a measurement raises."""
    alone_kv = under_prefix(kv, ALONE_PREFIX)
    expected = renamed(objects, kv, alone_kv)
    alone_keys = deployment_key_pattern(alone_kv.shards[0].namespace)
    raw_keys = f"^{re.escape(RAW_PREFIX)}@"
    last: dict[str, Measured] = {}

    def alone() -> float:
        store.remove_by_regex(alone_keys, True)
        last["alone"] = pipeline_alone(make_graph, alone_kv, store, requests, expected, queue_capacity)
        return last["alone"].seconds

    def raw() -> float:
        store.remove_by_regex(raw_keys, True)
        last["raw"] = raw_put(store, objects)
        return last["raw"].seconds

    try:
        medians, _ = alternate({"alone": alone, "raw": raw}, rounds)
        return Baselines(
            replace(last["alone"], seconds=medians["alone"]), replace(last["raw"], seconds=medians["raw"])
        )
    finally:
        store.remove_by_regex(alone_keys, True)
        store.remove_by_regex(raw_keys, True)


def raw_put(store: Store, records: Sequence[StoreObject], batch: int = BATCH) -> Measured:
    """Put ``records``' bytes again under ``RAW_PREFIX@`` + their key, ``batch`` a call; they stay.

    The whole loop is timed, the keys and buffer lists it builds too: a caller
    without the pipeline builds them as well.
    """
    stored, failed = 0, 0
    began = time.perf_counter()
    for start in range(0, len(records), batch):
        chunk = records[start : start + batch]
        spans = [record.transfer_spans() for record in chunk]
        codes = store.batch_put_from_multi_buffers(
            [f"{RAW_PREFIX}@{record.key}" for record in chunk],
            [list(addresses) for addresses, _ in spans],
            [list(lengths) for _, lengths in spans],
            store.new_replicate_config(),
        )
        stored += sum(record.size for record, code in zip(chunk, codes, strict=True) if code == 0)
        failed += sum(1 for code in codes if code != 0)
    return Measured(time.perf_counter() - began, stored, failed)


def under_prefix(kv: KVCache, cache_prefix: str) -> KVCache:
    """``kv`` with every rank's keys under ``cache_prefix``: the same memory, other objects."""
    shards = tuple(
        replace(shard, namespace=replace(shard.namespace, cache_prefix=cache_prefix)) for shard in kv.shards
    )
    return replace(kv, shards=shards)


def renamed(objects: Sequence[StoreObject], kv: KVCache, other: KVCache) -> dict[str, int]:
    """The keys ``objects`` (of ``kv``) have in ``other`` (the same cache under other namespaces), with their sizes."""
    prefixes = {
        object_key_prefix(ours.namespace, group.store_group): object_key_prefix(theirs.namespace, group.store_group)
        for ours, theirs in zip(kv.shards, other.shards, strict=True)
        for group in storable_groups(kv)
    }
    keys = {}
    for record in objects:
        hex_hash = record.chunk_hash.hex()
        keys[prefixes[record.key[: -len(hex_hash)]] + hex_hash] = record.size
    return keys


def pipeline_alone(
    make_graph: Callable[[KVCache, ObjectObserver | None], Graph],
    kv: KVCache,
    store: Store,
    requests: Sequence[SaveRequest],
    expected: dict[str, int],
    queue_capacity: int,
) -> Measured:
    """The save requests through ``make_graph``'s pipeline on ``kv`` with nothing else running; its objects stay.

    Its bytes are those of the ``expected`` objects (key: size) the store holds
    once it ran, asked after the clock stopped: an observer told of every object
    would be timed with the pipeline, and the raw puts have none.
    """
    pipeline = SyncPipeline(make_graph(kv, None), queue_capacity=queue_capacity, when_full="wait", name="alone")
    failed = 0
    with pipeline:
        began = time.perf_counter()
        for request in requests:
            pipeline.submit(request)
        for _ in requests:
            job = pipeline.next_completed(timeout_s=None)
            assert job is not None  # no timeout: it waits for the job
            failed += job.counts.get("failed", 0)
        seconds = time.perf_counter() - began
    keys = list(expected)
    stored = sum(expected[key] for key, answer in zip(keys, store.batch_is_exist(keys), strict=True) if answer == EXISTS)
    return Measured(seconds, stored, failed)
