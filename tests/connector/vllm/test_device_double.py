"""The device path's promises, proved on CPU with a device double (:mod:`.device_double`).

The double queues every copy and runs it only when a fence is waited for or the
engine's next forward reaches a fence its stream waits on, so a missing wait or
ordering shows as stale bytes, and it counts launches and blocking waits per thread.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.connector.vllm.kv_layout import group_layout
from kvpipe.connector.vllm.settings import settings_from
from kvpipe.connector.vllm.staging_area import StagingArea
from kvpipe.connector.vllm.worker import WorkerSide
from kvpipe.stages import LoadRequest, SaveRequest

from ...stages.kv_fixtures import chain_hashes
from .caches import engine_cache
from .device_double import DeviceDouble
from .test_device_path import BITS, BLOCK, SHAPE, layout_views

BLOCKS = 100
MANY = {**SHAPE, "B": BLOCKS}
LAYOUTS = ["LBHNC", "LHBNC"]  # one region per layer; one region per head of each layer


def per_layer(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same views, each layer in an allocation of its own (strides kept), as vLLM allocates them."""
    return {name: view.clone() for name, view in views.items()}


def staging(views: dict[str, torch.Tensor], name: str, double: DeviceDouble) -> StagingArea:
    return StagingArea({0: (group_layout(views, BLOCKS, name),)}, slots=BLOCKS, device=double)


def launches_to_save(name: str, blocks: int) -> int:
    double = DeviceDouble()
    area = staging(per_layer(layout_views(name, "cpu", shape=MANY)), name, double)
    area.copy_in([(0, slot, block) for block, slot in enumerate(area.take(blocks))])
    return sum(double.launches.values())


def launches_to_load(name: str, blocks: int) -> int:
    double = DeviceDouble()
    area = staging(per_layer(layout_views(name, "cpu", shape=MANY)), name, double)
    area.copy_out([(0, slot, block) for block, slot in enumerate(area.take(blocks))])
    return sum(double.launches.values())


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_save_step_launches_as_many_copies_for_a_hundred_blocks_as_for_one(name: str) -> None:
    assert launches_to_save(name, BLOCKS) == launches_to_save(name, 1)


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_load_step_launches_as_many_copies_for_a_hundred_blocks_as_for_one(name: str) -> None:
    assert launches_to_load(name, BLOCKS) == launches_to_load(name, 1)


def test_regions_that_line_up_in_one_allocation_are_gathered_by_one_launch() -> None:
    double = DeviceDouble()
    area = staging(layout_views("LHBNC", "cpu", shape=MANY), "LHBNC", double)  # every head of every layer
    area.copy_in([(0, slot, block) for block, slot in enumerate(area.take(BLOCKS))])
    assert sum(double.launches.values()) == 3  # the index's upload, one gather, one transfer to the slots


def test_the_next_forward_cannot_overwrite_a_block_before_the_save_has_read_it() -> None:
    double = DeviceDouble()
    views = layout_views("LBHNC", "cpu", shape=MANY)
    area = staging(views, "LBHNC", double)
    (slot,) = area.take(1)
    before = {layer: view[4].clone() for layer, view in views.items()}
    fence = area.copy_in([(0, slot, 4)])
    double.forward()
    for view in views.values():
        view[4].view(BITS).fill_(7)  # the forward reuses the block
    fence.wait()
    staged = area.arena.view(BLOCKS, -1)[slot]
    assert torch.equal(staged, torch.cat([before[layer].view(torch.uint8).flatten() for layer in views]))


def test_a_slot_given_back_is_reused_only_once_the_copy_reading_it_is_done() -> None:
    double = DeviceDouble()
    area = staging(layout_views("LBHNC", "cpu", shape=MANY), "LBHNC", double)
    slots = area.take(2)
    area.copy_out([(0, slots[0], 1), (0, slots[1], 2)])
    area.give_back(slots)
    assert area.free == BLOCKS - 2
    double.forward()
    assert area.free == BLOCKS


def worker(store: MemoryStore, double: DeviceDouble | None = None) -> WorkerSide:
    """A worker over ``layout_views``' LBHNC cache; with ``double`` it stages as on a device."""
    layers = tuple(f"layer.{layer}" for layer in range(SHAPE["L"]))
    cache = engine_cache(layers, block_size=BLOCK, num_blocks=SHAPE["B"], layout_name="LBHNC")
    settings = settings_from({"store": {"kind": "memory"}, "staging_blocks": 8})
    return WorkerSide(cache, settings, store, staging_device=double)


HASHES = chain_hashes(2, salt="double")
SAVE = SimpleNamespace(saves=[SaveRequest("s", HASHES, ((5, 2),), 2 * BLOCK)])
LOAD = SimpleNamespace(loads=[LoadRequest("l", HASHES, ((1, 3),), 0, 2 * BLOCK)], sync_loads=set())


def save(store: MemoryStore, source: dict[str, torch.Tensor], double: DeviceDouble | None = None) -> None:
    saver = worker(store, double)
    saver.register_kv_caches(source)
    saver.wait_for_save(SAVE)
    assert saver.drain(10.0) and saver.stats["objects_put"] == 2
    saver.shutdown(owns_store=False)


def load(store: MemoryStore, target: dict[str, torch.Tensor], double: DeviceDouble | None = None) -> None:
    """Blocks 5 and 2 of the save into blocks 1 and 3 of ``target``; returns once ``get_finished`` reports it."""
    loader = worker(store, double)
    loader.register_kv_caches(target)
    loader.start_load_kv(LOAD)
    deadline = time.monotonic() + 10
    while not (finished := loader.get_finished()) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert finished == {"l"} and loader.get_block_ids_with_load_errors() == set()
    loader.shutdown(owns_store=False)


def loaded_as_saved(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> bool:
    return all(
        torch.equal(target[layer][loaded].view(BITS), source[layer][saved].view(BITS))
        for layer in source
        for saved, loaded in ((5, 1), (2, 3))
    )


def test_the_save_pipeline_waits_for_the_copy_before_its_put_reads_the_slot() -> None:
    store, double = MemoryStore(16 << 20), DeviceDouble()
    source, target = layout_views("LBHNC", "cpu", seed=3), layout_views("LBHNC", "cpu", seed=4)
    save(store, source, double)
    load(store, target)  # straight into the blocks: no double on this side
    assert loaded_as_saved(source, target)


def test_a_loads_copies_into_the_engines_blocks_are_ordered_before_the_next_forward() -> None:
    store, double = MemoryStore(16 << 20), DeviceDouble()
    source, target = layout_views("LBHNC", "cpu", seed=3), layout_views("LBHNC", "cpu", seed=4)
    save(store, source)
    load(store, target, double)
    assert not loaded_as_saved(source, target)  # reported, but only queued: nothing waited for it
    double.forward()
    assert loaded_as_saved(source, target)


def test_the_engine_thread_never_blocks_over_save_and_load_steps() -> None:
    store, double = MemoryStore(16 << 20), DeviceDouble()
    save(store, layout_views("LBHNC", "cpu", seed=3), double)
    load(store, layout_views("LBHNC", "cpu", seed=4), double)
    double.forward()
    engine = threading.current_thread().name
    assert double.launches[engine] > 0 and double.waits[engine] == 0
    assert sum(double.waits.values()) > 0  # the save pipeline's thread waited instead
