"""Seals move through memory made without an OpenMP parallel region off the engine's thread.

A parallel torch op run from a pipeline's thread gives the process a second
OpenMP pool, and from then on every parallel region of the engine's own thread
sleeps and wakes at its barriers (:mod:`.openmp`): plain decode steps took
1.6-1.9x as long once seal memory was zero-filled with torch in a worker thread.
"""

from __future__ import annotations

import threading
import time
import warnings

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.pipeline.testing import batch_of
from kvpipe.stages import LoadParams, LoadRequest, LoadStage

from .kv_fixtures import make_kv, make_request
from .openmp import openmp_workers
from .save_path import run_save_path

with warnings.catch_warnings():  # this CPU torch build warns at import that numpy is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

BIG_ENOUGH_TO_PARALLELIZE = 1 << 20  # bytes: far above torch's grain for one parallel fill
SEEN_WITHIN_S = 10.0


def _start_this_thread_s_pool() -> None:
    torch.zeros(BIG_ENOUGH_TO_PARALLELIZE, dtype=torch.uint8)


def test_a_parallel_torch_op_in_another_thread_is_seen_as_a_pool_of_its_own():
    _start_this_thread_s_pool()
    before = openmp_workers()
    counted = threading.Event()
    other = threading.Thread(target=lambda: (_start_this_thread_s_pool(), counted.wait(10)))
    other.start()
    try:
        # a worker still spinning is not seen yet: look again until it sleeps (a busy machine
        # may leave it off a core a while), within a deadline
        deadline = time.monotonic() + SEEN_WITHIN_S
        while (during := openmp_workers()) <= before and time.monotonic() < deadline:
            pass
    finally:
        counted.set()
        other.join()

    assert torch.get_num_threads() == 1 or during > before


async def test_a_sealed_save_and_load_start_no_openmp_pool_of_their_own():
    source, target = make_kv(), make_kv(seed=1)
    saved = make_request(source.kv, 48)
    store = MemoryStore(lease_ttl_s=0)
    _start_this_thread_s_pool()  # the engine's thread has its pool; none other may appear
    before = openmp_workers()

    await run_save_path(source.kv, store, [saved], sealed=True)  # the put's seal memory
    load = LoadStage(LoadParams(integrity="verify"), target.kv, store)
    (entry,) = batch = batch_of([LoadRequest("load", saved.block_hashes, ((10, 11, 12),), 0, 48)])
    try:
        await load.process_batch(batch)  # the load's seal memory
        workers = openmp_workers()
    finally:
        await load.stop()

    assert entry.emit.counts["integrity_verified"] == 3  # read through seal memory
    # no more than before: a worker of the old pool still spinning is not seen (one fewer),
    # a new pool's would be one more
    assert workers <= before
