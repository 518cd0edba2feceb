"""Soak: 200,000 small save requests through the sync bridge, as a connector sends them.

The default save graph into a MemoryStore small enough to evict all along
(256 KiB against ~100 MiB of objects offered), fed from this thread under
``when_full="wait"`` and drained through ``completed()`` every thousand submits,
as a connector releasing blocks would. A sampler thread reads every stage's
inbox depth (``metrics()``) while it runs. Checked:

- resident memory after the run is within 10% of what it was after a
  20,000-request warm-up (a job, request or record kept per request would be
  tens of MB), and neither the gc-tracked objects nor the interpreter's
  allocated blocks grew by anything near one per request;
- the bridge's entry never holds more than ``queue_capacity`` items, no stage
  inbox more than its capacity, and the jobs in flight stay within what the
  queues and batches can hold;
- every job ends and is handed back exactly once: submitted = ok + partial +
  failed + dropped, and the pipeline has no open job left.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections import Counter

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.pipeline import Job, Outcome, SyncPipeline
from kvpipe.stages import SaveRequest, default_save_graph

from ..stages.kv_fixtures import make_kv

REQUESTS = 200_000
WARM_UP = 20_000
DRAIN_EVERY = 1_000
QUEUE_CAPACITY = 1024
HASH_BLOCK = 8  # half a block: every fourth request, finished, also saves a partial tail
BLOCKS = 256
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def request(i: int) -> SaveRequest:
    """One chunk (a quarter also a tail): half new, a third of the rest re-saves of a hot few."""
    if i % 2:
        n = i
    elif i % 3:
        n = i // 2  # saved before: existing, or put again once evicted
    else:
        n = i % 97  # hot: mostly existing
    prefix = n.to_bytes(30, "big")
    finished = i % 4 == 0
    tokens = 24 if finished else 16
    hashes = tuple(prefix + k.to_bytes(2, "big") for k in range(tokens // HASH_BLOCK))
    first = 1 + (i % (BLOCKS - 2))
    return SaveRequest(f"r{i}", hashes, ((first, first + 1),), tokens, 0, finished)


class Sampler(threading.Thread):
    """Reads the bridge's stage metrics every few milliseconds; keeps each stage's deepest inbox."""

    def __init__(self, bridge: SyncPipeline, every_s: float = 0.005) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.bridge = bridge
        self.every_s = every_s
        self.max_depth: Counter[str] = Counter()
        self.samples = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.every_s):
            for name, snapshot in self.bridge.metrics().items():
                self.max_depth[name] = max(self.max_depth[name], snapshot.queue_depth)
            self.samples += 1


def test_soak_200k_requests_memory_flat_queues_bounded_no_job_lost():
    kv = make_kv(layers=1, num_blocks=BLOCKS, hash_block_size=HASH_BLOCK).kv
    store = MemoryStore(256 << 10, lease_ttl_s=0.0)
    graph = default_save_graph(kv, store)
    capacities = {spec.name: spec.capacity for spec in graph.specs}
    # Jobs in flight: the entry, every inbox, and what the workers hold (a batch each).
    in_flight_bound = (
        QUEUE_CAPACITY
        + 1
        + sum(
            spec.capacity + spec.workers * (spec.batch_policy.max_items if spec.is_batch else 1)
            for spec in graph.specs
        )
    )
    outcomes: Counter[str] = Counter()
    handed_back = 0
    not_done = 0
    max_queued = 0
    max_in_flight = 0

    def drain(jobs: list[Job]) -> None:
        nonlocal handed_back, not_done
        handed_back += len(jobs)
        for job in jobs:
            not_done += not job.done
            outcomes[job.outcome.value if job.outcome else "none"] += 1

    started = time.perf_counter()
    bridge = SyncPipeline(graph, queue_capacity=QUEUE_CAPACITY, when_full="wait").start()
    sampler = Sampler(bridge)
    sampler.start()
    try:
        for i in range(REQUESTS):
            bridge.submit(request(i))
            max_queued = max(max_queued, bridge.queued)
            if i % DRAIN_EVERY == DRAIN_EVERY - 1:
                drain(bridge.completed())
                max_in_flight = max(max_in_flight, i + 1 - handed_back)
            if i == WARM_UP - 1:
                gc.collect()
                rss_warm, objects_warm, blocks_warm = (
                    rss_bytes(),
                    len(gc.get_objects()),
                    sys.getallocatedblocks(),
                )
                warm_at = time.perf_counter()
        gc.collect()
        rss_end, objects_end, blocks_end = rss_bytes(), len(gc.get_objects()), sys.getallocatedblocks()
        end_at = time.perf_counter()
    finally:
        sampler.stop_event.set()
        sampler.join()
        drained = bridge.stop(deadline_s=30.0)
    drain(bridge.completed())
    elapsed = time.perf_counter() - started
    open_jobs = len(bridge._pipeline.jobs) if bridge._pipeline is not None else 0
    growth = (rss_end - rss_warm) / rss_warm
    report = (
        f"{REQUESTS} requests in {elapsed:.1f} s ({(REQUESTS - WARM_UP) / (end_at - warm_at):,.0f}/s after "
        f"warm-up); RSS {rss_warm / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB ({growth:+.1%}); "
        f"gc objects {objects_warm} -> {objects_end}; allocated blocks {blocks_warm} -> {blocks_end}; "
        f"max queued {max_queued}/{QUEUE_CAPACITY}; max in flight {max_in_flight}/{in_flight_bound}; "
        f"max inbox depths {dict(sampler.max_depth)} over {sampler.samples} samples; "
        f"outcomes {dict(outcomes)}; store {store.stats()}"
    )
    print(report)

    assert drained, report
    assert growth < 0.10, report
    # Anything kept per request would be one object or block per request at least: 180,000.
    assert objects_end - objects_warm < (REQUESTS - WARM_UP) // 2, report
    assert blocks_end - blocks_warm < (REQUESTS - WARM_UP) // 2, report
    assert max_queued <= QUEUE_CAPACITY, report
    assert sampler.samples > 10, report
    for name, depth in sampler.max_depth.items():
        # +1: the sampler reads from its own thread, and may catch anyio's receive in the
        # middle of moving a waiting sender's item into the full buffer to hand one out
        assert depth <= capacities[name] + 1, f"{name}: {depth} > {capacities[name]} + 1; {report}"
    assert max_in_flight <= in_flight_bound, report
    assert handed_back == REQUESTS and not_done == 0 and open_jobs == 0, report
    assert bridge.submitted + bridge.dropped == REQUESTS, report
    assert sum(outcomes.values()) == REQUESTS, report
    assert dict(outcomes) == bridge.outcomes(), report
    assert outcomes[Outcome.OK.value] == REQUESTS, report  # nothing fails on a store that only evicts
    assert store.stats().evicted_objects > 0, report
