"""Retention on a real master: the save pipeline pins what requests keep asking for, and it stays.

A 16 MiB segment (the smallest the client mounts) takes a few reused chunks, then
a flood of one-off requests three times its size. Without pins the master would
evict the oldest objects first, which the reused ones are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from kvpipe.connector.bench.kvbench import BenchCache, MiB
from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster
from kvpipe.pipeline import SyncPipeline
from kvpipe.stages import EXISTS, default_save_graph

SEGMENT = 16 * MiB
CHUNK_BYTES = 256 * 1024  # 4 layers of 64 KiB
HOT_CHUNKS = 8  # 2 MiB: an eighth of the store


@pytest.fixture(scope="module")
def master() -> Iterator[LocalMaster]:
    with LocalMaster(lease_ttl_ms=100) as master:  # short leases: nothing read stays shielded long
        yield master


@pytest.fixture
def store(master: LocalMaster) -> Iterator[MooncakeStore]:
    assert master.endpoints is not None
    settings = MooncakeSettings(
        master=master.endpoints.master_address,
        metadata_server=master.endpoints.metadata_server,
        global_segment_size=SEGMENT,
        local_buffer_size=16 * MiB,
    )
    # closing the client unmounts its segment: the next test starts on an empty store
    with MooncakeStore.open(settings) as opened:
        yield opened


def _saved_then_flooded(store: MooncakeStore, *, pinned_bytes: int, reuse: int) -> list[int]:
    """Save the hot chunks (marked reused by ``reuse`` requests), flood the store; what is left of them."""
    cache = BenchCache.build(layers=4, buffer_bytes=CHUNK_BYTES // 4, num_blocks=HOT_CHUNKS + 1)
    pipeline = SyncPipeline(default_save_graph(cache.kv, store, throttle=None, max_pinned_bytes=pinned_bytes))
    (hot,) = cache.requests([HOT_CHUNKS], salt="hot")
    hot = dataclasses.replace(hot, reused_chunks=dict.fromkeys(hot.block_hashes, reuse))
    flood = cache.requests([HOT_CHUNKS] * (3 * SEGMENT // (HOT_CHUNKS * CHUNK_BYTES)), salt="one-off")
    with cache.registered(store), pipeline:
        pipeline.submit(hot).wait()
        for request in flood:
            pipeline.submit(request).wait()
    keys = [record.key for record in cache.records_of(hot)]
    return store.batch_is_exist(keys)


def test_chunks_requests_keep_asking_for_outlive_a_flood_of_one_off_requests(store: MooncakeStore) -> None:
    assert _saved_then_flooded(store, pinned_bytes=SEGMENT // 2, reuse=2) == [EXISTS] * HOT_CHUNKS


def test_without_a_pin_budget_the_same_chunks_are_evicted_by_the_flood(store: MooncakeStore) -> None:
    left = _saved_then_flooded(store, pinned_bytes=0, reuse=2)

    assert all(code >= 0 for code in left)  # answers, not errors
    assert left.count(EXISTS) < HOT_CHUNKS


def test_a_flood_into_a_full_store_of_unleased_objects_has_no_put_refused(store: MooncakeStore) -> None:
    """Each refusal for space starts an eviction; the put stage waits for it rather than drop the save."""
    cache = BenchCache.build(layers=4, buffer_bytes=CHUNK_BYTES // 4, num_blocks=HOT_CHUNKS + 1)
    pipeline = SyncPipeline(default_save_graph(cache.kv, store, throttle=None))
    flood = cache.requests([HOT_CHUNKS] * (3 * SEGMENT // (HOT_CHUNKS * CHUNK_BYTES)), salt="flood")
    with cache.registered(store), pipeline:
        jobs = [pipeline.submit(request) for request in flood]
        for job in jobs:
            job.wait()
    counts = [job.counts for job in jobs]

    assert sum(c.get("put", 0) for c in counts) == len(flood) * HOT_CHUNKS
    assert sum(c.get("backpressure", 0) for c in counts) == 0
