"""The worker side on vLLM's own KV views, every layout: save, then load into another engine's cache.

No engine runs: the views are what vLLM's ``create_kv_cache_views`` makes, the
store is the in-process model, and the worker is driven as vLLM drives it
(``register_kv_caches``, ``wait_for_save``, ``start_load_kv``, ``get_finished``).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvpipe.connector.store.memory import Faults, MemoryStore
from kvpipe.connector.vllm.device import HostThreadDevice
from kvpipe.connector.vllm.messages import KVPipeMetadata
from kvpipe.connector.vllm.settings import settings_from
from kvpipe.connector.vllm.worker import WorkerSide
from kvpipe.stages import GroupKind, GroupSpec, LoadRequest, SaveRequest

from ...stages.kv_fixtures import chain_hashes
from ...stages.stores import StalledGets, StalledPuts
from .caches import engine_cache
from .test_host_copy_thread import WITHIN_S, Gate
from .test_kv_layout import LAYERS, NUM_BLOCKS, engine_views

BLOCK = 16
HASHES = chain_hashes(3, salt="w")
BITS = torch.int16  # random bytes make NaNs of bfloat16: compare the bits


def worker(store: MemoryStore, layout: KVCacheLayout, settings: dict | None = None, **kwargs) -> WorkerSide:
    cache = engine_cache(LAYERS, num_blocks=NUM_BLOCKS, layout_name=layout.name)
    connector = settings_from({"store": {"kind": "memory"}, "staging_blocks": 8, **(settings or {})})
    return WorkerSide(cache, connector, store, **kwargs)


def wait_finished(side: WorkerSide, timeout_s: float = 10.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    finished: set[str] = set()
    while not finished and time.monotonic() < deadline:
        finished = side.get_finished()
        time.sleep(0.005)
    return finished


def save_three_blocks(store: MemoryStore, layout: KVCacheLayout, settings: dict | None = None) -> dict[str, torch.Tensor]:
    views = engine_views(layout)
    saver = worker(store, layout, settings)
    saver.register_kv_caches(views)
    saver.wait_for_save(KVPipeMetadata(saves=[SaveRequest("s", HASHES, ((4, 1, 5),), 3 * BLOCK)]))
    assert saver.drain(10.0)
    assert saver.stats["objects_put"] == 3
    saver.shutdown(owns_store=False)
    return views


def test_objects_a_save_could_not_store_are_counted_by_why() -> None:
    store = MemoryStore(faults=Faults(error_rates={"put": {-800: 1.0}}))
    saver = worker(store, KVCacheLayout.LBHNC)
    saver.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    saver.wait_for_save(KVPipeMetadata(saves=[SaveRequest("s", HASHES, ((4, 1, 5),), 3 * BLOCK)]))
    assert saver.drain(10.0)
    saver.shutdown(owns_store=False)
    assert (saver.stats["objects_failed"], saver.stats["object_failures_store_error"]) == (3, 3)


@pytest.mark.parametrize("via_staging", [False, True], ids=["into-blocks", "via-staging"])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_saved_blocks_load_into_another_cache_byte_for_byte(layout: KVCacheLayout, via_staging: bool) -> None:
    store = MemoryStore(16 << 20)
    source = save_three_blocks(store, layout)
    target = engine_views(layout)
    loader = worker(store, layout, {"load_via_staging": via_staging})
    loader.register_kv_caches(target)
    loader.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)]))
    assert wait_finished(loader) == {"l"}
    assert loader.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        for saved, loaded in ((4, 0), (1, 2), (5, 3)):
            assert torch.equal(target[name][loaded].view(BITS), source[name][saved].view(BITS))
    loader.shutdown(owns_store=False)


@pytest.mark.parametrize("via_staging", [False, True], ids=["into-blocks", "via-staging"])
def test_a_load_of_missing_objects_reports_its_blocks_failed_and_finishes(via_staging: bool) -> None:
    store = MemoryStore(16 << 20)
    loader = worker(store, KVCacheLayout.LBHNC, {"load_via_staging": via_staging})
    loader.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    loader.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, ((0, 2, 3),), 0, 2 * BLOCK)]))
    assert wait_finished(loader) == {"l"}
    assert loader.get_block_ids_with_load_errors() == {0, 2}
    assert loader.get_finished() == set()  # reported once
    loader.shutdown(owns_store=False)


@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "two-groups"])
def test_load_failures_not_yet_taken_are_still_told_after_shutdown(groups: int) -> None:
    """One group's failed blocks go to vLLM as block ids; several groups' as the request."""
    cache = engine_cache(
        LAYERS, groups=[GroupSpec(GroupKind.FULL_ATTENTION, BLOCK)] * groups, num_blocks=NUM_BLOCKS
    )
    connector = settings_from({"store": {"kind": "memory"}, "staging_blocks": 8})
    loader = WorkerSide(cache, connector, MemoryStore(16 << 20))
    loader.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    blocks = ((0, 2, 3), (1, 4, 5))[:groups]
    loader.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, blocks, 0, 2 * BLOCK)]))
    assert wait_finished(loader) == {"l"}
    loader.shutdown(owns_store=False)
    told = ({0, 2}, set()) if groups == 1 else (set(), {"l"})
    assert (loader.get_block_ids_with_load_errors(), loader.take_failed_requests()) == told
    assert (loader.get_block_ids_with_load_errors(), loader.take_failed_requests()) == (set(), set())


def loader_after_three_saves(
    settings: dict | None = None, store: MemoryStore | None = None
) -> tuple[WorkerSide, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A started worker over an empty cache, three blocks saved by another: (loader, source, target)."""
    store = MemoryStore(16 << 20) if store is None else store
    source = save_three_blocks(store, KVCacheLayout.LBHNC)
    target = engine_views(KVCacheLayout.LBHNC)
    loader = worker(store, KVCacheLayout.LBHNC, settings)
    loader.register_kv_caches(target)
    return loader, source, target


IN_PLACE = {"load_via_staging": False}  # loads land in the engine's blocks, registered with the store
#: a given-up load's blocks: those of its whole range
GIVEN_UP = {0, 2, 3}
QUICK_DEADLINE = {"load_deadline_s": 1.0}
#: for a test whose second load must start before its deadline: room for a busy machine
ROOMY_DEADLINE = {"load_deadline_s": 3.0}


def given_up_blocks(target: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """A copy of what the blocks of a given-up load hold, per layer."""
    return [target[name][list(GIVEN_UP)].clone() for name in LAYERS]


def unchanged(target: dict[str, torch.Tensor], before: list[torch.Tensor]) -> bool:
    return all(torch.equal(now.view(BITS), then.view(BITS)) for now, then in zip(given_up_blocks(target), before, strict=True))


def stalled_load(sync: bool) -> tuple[StalledGets, WorkerSide, dict[str, torch.Tensor], list[torch.Tensor]]:
    """A load of three stored blocks whose store call hangs: (store, loader, target, the blocks before it)."""
    store = StalledGets()
    loader, _, target = loader_after_three_saves(QUICK_DEADLINE, store)
    before = given_up_blocks(target)
    load = LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)
    loader.start_load_kv(KVPipeMetadata(loads=[load], sync_loads={"l"} if sync else set()))
    return store, loader, target, before


def test_a_sync_load_past_its_deadline_is_given_up_while_its_store_call_still_runs() -> None:
    store, loader, target, before = stalled_load(sync=True)
    assert store.hanging == 1  # the engine went on: it did not wait for the call
    assert loader.get_block_ids_with_load_errors() == GIVEN_UP  # recomputed
    assert loader.stats["loads_given_up"] == 1
    assert unchanged(target, before)
    store.let_go.set()
    loader.shutdown(owns_store=False)


def test_an_async_load_past_its_deadline_is_reported_finished_with_every_block_failed() -> None:
    store, loader, target, before = stalled_load(sync=False)
    assert wait_finished(loader) == {"l"}
    assert store.hanging == 1
    assert loader.get_block_ids_with_load_errors() == GIVEN_UP
    assert unchanged(target, before)
    store.let_go.set()
    loader.shutdown(owns_store=False)


def test_a_given_up_loads_late_bytes_stay_in_its_slots_which_come_back_when_its_call_ends() -> None:
    store, loader, target, before = stalled_load(sync=False)
    assert wait_finished(loader) == {"l"}
    assert loader._staging.free == 8 - 3  # its call may still write them
    store.let_go.set()
    deadline = time.monotonic() + 10.0
    while loader._staging.free < 8 and time.monotonic() < deadline:
        loader.get_finished()  # each step reaps
        time.sleep(0.005)
    assert loader._staging.free == 8
    assert unchanged(target, before)  # the late bytes were never copied in
    assert loader.get_block_ids_with_load_errors() == GIVEN_UP  # told once, at its deadline
    assert loader.get_finished() == set()
    loader.shutdown(owns_store=False)


def test_a_given_up_loads_late_answer_never_settles_a_later_load_of_the_same_request() -> None:
    store = StalledGets()
    loader, source, target = loader_after_three_saves(ROOMY_DEADLINE, store)
    loader.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)]))
    given_up = loader._loads.in_flight["l"].job
    assert wait_finished(loader) == {"l"} and loader.get_block_ids_with_load_errors() == GIVEN_UP
    store.let_go.set()
    assert given_up.wait(10.0)  # its answer (every block loaded) is in, unreaped
    again = LoadRequest("l", (HASHES[0], chain_hashes(1, salt="never stored")[0]), ((1, 4),), 0, 2 * BLOCK)
    loader.start_load_kv(KVPipeMetadata(loads=[again]))
    assert loader._loads.in_flight["l"].job.wait(10.0)
    assert loader.get_finished() == {"l"}  # reaps the given-up load, then settles this one
    assert loader.get_block_ids_with_load_errors() == {4}
    assert torch.equal(target[LAYERS[0]][1].view(BITS), source[LAYERS[0]][4].view(BITS))
    loader.shutdown(owns_store=False)


def test_a_load_in_place_is_not_given_up_while_its_call_may_write_the_engines_blocks() -> None:
    store = StalledGets()
    loader, source, target = loader_after_three_saves({**QUICK_DEADLINE, "load_via_staging": False}, store)
    loader.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)]))
    job = loader._loads.in_flight["l"].job
    while not job.expired:
        time.sleep(0.01)
    assert loader.get_finished() == set()
    store.let_go.set()
    assert wait_finished(loader) == {"l"}
    assert loader.get_block_ids_with_load_errors() == set()
    assert torch.equal(target[LAYERS[0]][0].view(BITS), source[LAYERS[0]][4].view(BITS))
    loader.shutdown(owns_store=False)


#: slots for a load of three blocks only once a stalled save of two gives its slots back
FOUR_SLOTS = {"staging_blocks": 4}
OTHER_HASHES = chain_hashes(2, salt="other")


def slots_held_by_a_save(
    settings: dict | None = None,
) -> tuple[StalledPuts, WorkerSide, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Three blocks stored; a worker over four slots whose own save of two more hangs in its put.

    Returns (store, worker, the three blocks' source views, the worker's views).
    """
    store = StalledPuts(stalled=0)
    loader, source, target = loader_after_three_saves({**FOUR_SLOTS, **(settings or {})}, store)
    store.stalled = 1
    loader.wait_for_save(KVPipeMetadata(saves=[SaveRequest("s", OTHER_HASHES, ((1, 4),), 2 * BLOCK)]))
    assert loader._staging.free == 2
    return store, loader, source, target


THREE_BLOCKS = LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)


def landed_whole(loader: WorkerSide, source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> bool:
    """THREE_BLOCKS failed in no block, and its last block holds the bytes saved from block 5."""
    failed = loader.get_block_ids_with_load_errors()
    return not failed and torch.equal(target[LAYERS[0]][3].view(BITS), source[LAYERS[0]][5].view(BITS))


def test_an_async_load_meeting_saves_that_hold_its_slots_starts_once_they_give_them_back() -> None:
    store, loader, source, target = slots_held_by_a_save(ROOMY_DEADLINE)
    loader.start_load_kv(KVPipeMetadata(loads=[THREE_BLOCKS]))
    assert loader.get_finished() == set()  # still waiting: the save's put hangs
    assert loader.stats["loads_waited_for_staging"] == 1

    store.let_go.set()

    assert wait_finished(loader) == {"l"}
    assert landed_whole(loader, source, target)
    assert loader.stats["loads_failed_no_staging"] == 0
    loader.shutdown(owns_store=False)


def test_a_sync_load_meeting_saves_that_hold_its_slots_has_landed_when_start_load_kv_returns() -> None:
    store, loader, source, target = slots_held_by_a_save(ROOMY_DEADLINE)
    threading.Timer(0.2, store.let_go.set).start()

    loader.start_load_kv(KVPipeMetadata(loads=[THREE_BLOCKS], sync_loads={"l"}))

    assert landed_whole(loader, source, target)
    assert loader.stats["loads_waited_for_staging"] == 1
    loader.shutdown(owns_store=False)


def test_slots_a_save_gives_back_go_to_the_load_waiting_for_them_before_the_next_save() -> None:
    store, loader, _, _ = slots_held_by_a_save(ROOMY_DEADLINE)
    loader.start_load_kv(KVPipeMetadata(loads=[THREE_BLOCKS]))
    store.let_go.set()
    assert loader.drain(10.0)  # the save ended and gave its slots back; the load has not started

    loader.wait_for_save(KVPipeMetadata(saves=[SaveRequest("t", OTHER_HASHES, ((1, 4),), 2 * BLOCK)]))

    assert loader.stats["saves_dropped_no_staging"] == 1  # one slot left once the load started
    assert wait_finished(loader) == {"l"}
    assert loader.get_block_ids_with_load_errors() == set()
    loader.shutdown(owns_store=False)


def test_while_a_load_waits_for_slots_a_steps_saves_take_none_of_the_free_ones() -> None:
    store, loader, source, target = slots_held_by_a_save(ROOMY_DEADLINE)
    loader.start_load_kv(KVPipeMetadata(loads=[THREE_BLOCKS]))  # three wanted, two free

    loader.wait_for_save(KVPipeMetadata(saves=[SaveRequest("t", OTHER_HASHES[:1], ((6,),), BLOCK)]))

    assert loader.stats["saves_dropped_no_staging"] == 1
    assert loader._staging.free == 2
    store.let_go.set()
    assert wait_finished(loader) == {"l"}
    assert landed_whole(loader, source, target)
    loader.shutdown(owns_store=False)


def test_a_load_that_does_not_fit_the_cache_fails_at_once_even_behind_a_load_waiting_for_slots() -> None:
    store, loader, _, _ = slots_held_by_a_save(ROOMY_DEADLINE)
    loader.start_load_kv(KVPipeMetadata(loads=[THREE_BLOCKS]))  # waits: the save holds its slots
    beyond = LoadRequest("x", HASHES, ((0, 2, 3),), 0, 5 * BLOCK)  # more tokens than hashes

    loader.start_load_kv(KVPipeMetadata(loads=[beyond]))

    assert wait_finished(loader) == {"x"}
    assert loader.get_block_ids_with_load_errors() == {0, 2, 3}
    store.let_go.set()
    assert wait_finished(loader) == {"l"}
    loader.shutdown(owns_store=False)


def test_a_load_still_waiting_for_slots_at_its_deadline_fails_whole() -> None:
    store, loader, _, _ = slots_held_by_a_save(QUICK_DEADLINE)
    loader.start_load_kv(KVPipeMetadata(loads=[THREE_BLOCKS]))

    assert wait_finished(loader) == {"l"}

    assert loader.get_block_ids_with_load_errors() == GIVEN_UP
    assert loader.stats["loads_failed_no_staging"] == 1
    store.let_go.set()
    loader.shutdown(owns_store=False)


def test_a_load_that_saves_could_not_make_room_for_fails_at_once() -> None:
    store = StalledGets()
    loader, _, _ = loader_after_three_saves({**FOUR_SLOTS, **ROOMY_DEADLINE}, store)
    loader.start_load_kv(KVPipeMetadata(loads=[THREE_BLOCKS]))  # its get hangs: three slots held
    other = LoadRequest("m", HASHES, ((1, 4, 5),), 0, 3 * BLOCK)

    loader.start_load_kv(KVPipeMetadata(loads=[other], sync_loads={"m"}))

    assert loader.get_block_ids_with_load_errors() == {1, 4, 5}
    assert loader.stats["loads_failed_no_staging"] == 1
    assert loader.stats["loads_waited_for_staging"] == 0
    store.let_go.set()
    loader.shutdown(owns_store=False)


def test_a_sync_load_has_landed_when_start_load_kv_returns() -> None:
    loader, source, target = loader_after_three_saves()
    sync = LoadRequest("l", HASHES, ((0, 2, 3),), 0, BLOCK)
    loader.start_load_kv(KVPipeMetadata(loads=[sync], sync_loads={"l"}))
    assert torch.equal(target[LAYERS[0]][0].view(BITS), source[LAYERS[0]][4].view(BITS))
    assert loader.get_finished() == set()  # a sync load is never reported as an async one
    loader.shutdown(owns_store=False)


def test_a_step_may_wait_for_its_sync_loads_and_leave_its_async_ones_running() -> None:
    loader, source, target = loader_after_three_saves()
    sync = LoadRequest("sync", HASHES, ((0, 2, 3),), 0, BLOCK)
    later = LoadRequest("later", HASHES, ((1, 4, 5),), 0, 3 * BLOCK)
    loader.start_load_kv(KVPipeMetadata(loads=[sync, later], sync_loads={"sync"}))
    assert torch.equal(target[LAYERS[0]][0].view(BITS), source[LAYERS[0]][4].view(BITS))
    assert wait_finished(loader) == {"later"}
    assert torch.equal(target[LAYERS[0]][1].view(BITS), source[LAYERS[0]][4].view(BITS))
    loader.shutdown(owns_store=False)


def test_a_stored_save_counts_as_landed_with_the_time_it_took() -> None:
    store = MemoryStore(16 << 20)
    side = worker(store, KVCacheLayout.LBHNC)
    side.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    before = time.monotonic()
    side.wait_for_save(KVPipeMetadata(saves=[SaveRequest("s", HASHES, ((4, 1, 5),), 3 * BLOCK)]))
    assert side.drain(10.0)
    took_ms = (time.monotonic() - before) * 1000
    landed = side.take_samples()["save_landing_seconds"]
    assert len(landed) == 1
    assert 0 <= landed[0] * 1000 <= took_ms
    assert "save_landing_seconds" not in side.take_samples()  # taken once
    side.shutdown(owns_store=False)


def test_a_load_of_chunks_another_worker_put_counts_them_as_from_others() -> None:
    loader, _, _ = loader_after_three_saves()
    loader.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)]))
    assert wait_finished(loader) == {"l"}
    assert loader.stats["chunks_loaded_from_others"] == 3
    loader.shutdown(owns_store=False)


def test_a_load_of_chunks_the_same_worker_put_is_not_from_others() -> None:
    store = MemoryStore(16 << 20)
    side = worker(store, KVCacheLayout.LBHNC)
    side.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    side.wait_for_save(KVPipeMetadata(saves=[SaveRequest("s", HASHES, ((4, 1, 5),), 3 * BLOCK)]))
    assert side.drain(10.0)
    side.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)]))
    assert wait_finished(side) == {"l"}
    assert side.stats["chunks_loaded"] == 3
    assert side.stats["chunks_loaded_from_others"] == 0
    side.shutdown(owns_store=False)


def engine_nice_plus(increment: int) -> int:
    """The nice value of a thread ``increment`` nicer than this (the engine's) thread."""
    return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + increment)


def pipeline_nices(settings: dict) -> tuple[set[int], set[int]]:
    """The nice values of the save pipeline's threads and of the load pipeline's."""
    cache = engine_cache(LAYERS, num_blocks=NUM_BLOCKS, layout_name=KVCacheLayout.LBHNC.name)
    side = WorkerSide(cache, settings_from({"store": {"kind": "memory"}, **settings}), MemoryStore(16 << 20))
    before = set(threading.enumerate())
    side.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    try:
        nices = {
            t.name: os.getpriority(os.PRIO_PROCESS, t.native_id)
            for t in set(threading.enumerate()) - before
            if t.native_id is not None
        }
    finally:
        side.shutdown(owns_store=False)
    saves = {nice for name, nice in nices.items() if "save" in name}
    loads = {nice for name, nice in nices.items() if "load" in name}
    return saves, loads


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread are Linux's")
def test_the_save_pipeline_runs_nicer_than_the_engine_and_the_load_pipeline_does_not() -> None:
    assert pipeline_nices({"save_nice": 7}) == ({engine_nice_plus(7)}, {engine_nice_plus(0)})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread are Linux's")
def test_the_load_pipeline_runs_as_much_nicer_as_load_nice_says() -> None:
    assert pipeline_nices({"save_nice": 0, "load_nice": 5}) == ({engine_nice_plus(0)}, {engine_nice_plus(5)})


def test_loads_start_when_the_steps_metadata_is_bound_and_go_out_once() -> None:
    loader, source, target = loader_after_three_saves()
    sync = LoadRequest("sync", HASHES, ((0, 2, 3),), 0, BLOCK)
    later = LoadRequest("later", HASHES, ((1, 4, 5),), 0, 3 * BLOCK)
    meta = KVPipeMetadata(loads=[sync, later], sync_loads={"sync"})
    loader.submit_loads(meta)  # what bind_connector_metadata does, before vLLM's start_load_kv
    assert wait_finished(loader) == {"later"}  # it ran without start_load_kv
    loader.start_load_kv(meta)
    assert torch.equal(target[LAYERS[0]][0].view(BITS), source[LAYERS[0]][4].view(BITS))
    assert loader.stats["loads"] == 2
    loader.shutdown(owns_store=False)


def test_sleep_lets_go_of_the_engines_memory_and_wake_up_takes_it_back() -> None:
    """vLLM 0.33's sleep mode: the KV caches' registrations go before sleep frees them, and come back."""
    loader, source, target = loader_after_three_saves(IN_PLACE)
    store = loader.store
    engine_storage = target[LAYERS[0]].untyped_storage().data_ptr()
    arena = loader._staging.arena.data_ptr()
    assert {engine_storage, arena} <= set(store._registered)
    loader.release_kv_caches()
    loader.release_kv_caches()  # idempotent
    assert arena in store._registered and engine_storage not in store._registered
    loader.restore_kv_caches()
    loader.restore_kv_caches()
    assert engine_storage in store._registered
    loader.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)]))
    assert wait_finished(loader) == {"l"}
    assert torch.equal(target[LAYERS[0]][3].view(BITS), source[LAYERS[0]][5].view(BITS))
    loader.shutdown(owns_store=False)


def test_sleep_waits_for_loads_in_flight_to_end() -> None:
    loader, _, _ = loader_after_three_saves(IN_PLACE)
    loader.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)]))
    loader.release_kv_caches()
    assert loader._loads.in_flight["l"].done  # nothing writes into the engine's memory once sleep frees it
    loader.shutdown(owns_store=False)


def test_loads_via_staging_leave_the_engines_memory_unregistered() -> None:
    loader, _, target = loader_after_three_saves()
    assert set(loader.store._registered) == {loader._staging.arena.data_ptr()}
    assert target[LAYERS[0]].untyped_storage().data_ptr() not in loader.store._registered
    loader.shutdown(owns_store=False)


def test_a_capacity_only_worker_touches_no_kv_cache() -> None:
    """vLLM's capacity-only mode (a kv_consumer without lookups or decode saves): it only lends its segment."""
    store = MemoryStore(16 << 20)
    side = worker(store, KVCacheLayout.LBHNC, transfers=False)
    side.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    assert not side.started and store._registered == {}
    side.wait_for_save(KVPipeMetadata(saves=[SaveRequest("s", HASHES, ((4, 1, 5),), 3 * BLOCK)]))
    side.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)]))
    assert side.get_finished() == set() and store.stats().objects == 0
    side.shutdown(owns_store=False)


def test_a_save_leaves_its_copy_to_the_copy_thread_and_stores_the_blocks_as_they_were() -> None:
    device = HostThreadDevice()
    store = MemoryStore(16 << 20)
    views = engine_views(KVCacheLayout.LBHNC)
    saved = {name: views[name][[4, 1, 5]].clone() for name in LAYERS}
    saver = worker(store, KVCacheLayout.LBHNC, staging_device=device)
    saver.register_kv_caches(views)
    gate = Gate(device)
    saver.wait_for_save(KVPipeMetadata(saves=[SaveRequest("s", HASHES, ((4, 1, 5),), 3 * BLOCK)]))
    assert gate.reached.wait(WITHIN_S)  # wait_for_save returned; the copy is held behind the gate
    next_step = threading.Thread(target=saver.before_step)
    next_step.start()
    assert next_step.is_alive()  # the next step may not start while the copy still reads the blocks
    gate.open()
    next_step.join(WITHIN_S)
    assert not next_step.is_alive()
    for name in LAYERS:  # the next step writes the blocks
        views[name][[4, 1, 5]] = 0
    assert saver.drain(WITHIN_S)
    saver.shutdown(owns_store=False)
    loader, target = worker(store, KVCacheLayout.LBHNC), engine_views(KVCacheLayout.LBHNC)
    loader.register_kv_caches(target)
    loader.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)]))
    assert wait_finished(loader) == {"l"}
    for name in LAYERS:
        assert torch.equal(target[name][[0, 2, 3]].view(BITS), saved[name].view(BITS))
    loader.shutdown(owns_store=False)


def test_a_step_start_that_waited_for_the_copies_is_observed_once_and_one_that_did_not_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = HostThreadDevice()
    saver = worker(MemoryStore(16 << 20), KVCacheLayout.LBHNC, staging_device=device)
    saver.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    gate = Gate(device)
    saver.wait_for_save(KVPipeMetadata(saves=[SaveRequest("s", HASHES, ((4, 1, 5),), 3 * BLOCK)]))
    assert gate.reached.wait(WITHIN_S)
    fence = device._engine_fence
    assert fence is not None
    joining = threading.Event()
    join = fence.join

    def announced_join() -> None:
        joining.set()
        join()

    monkeypatch.setattr(fence, "join", announced_join)
    next_step = threading.Thread(target=saver.before_step)
    next_step.start()
    assert joining.wait(WITHIN_S)  # the step start found the copies in flight and waits for them
    gate.open()
    next_step.join(WITHIN_S)

    (waited,) = saver.take_samples()["engine_copy_wait_seconds"]
    saver.before_step()  # nothing in flight: no wait

    assert waited > 0
    assert "engine_copy_wait_seconds" not in saver.take_samples()
    assert saver.drain(WITHIN_S)
    saver.shutdown(owns_store=False)
