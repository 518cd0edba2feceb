"""The device path: the same layout, staging and worker code on CPU tensors here and on CUDA where it exists.

A KV layout is a permutation of the logical ``[L, B, H, N, C]`` axes in memory
(vLLM's ``KVCacheLayout`` values); :func:`layout_views` builds the per-layer views
of one with torch alone, so the CUDA tests need no vLLM. On CPU the views are
checked against vLLM's own ``create_kv_cache_views``. Tests marked ``gpu`` run
where CUDA exists (``make gpu-check``); here they are skipped. The worker's
modules import vLLM, which the GPU check's bare ``python3`` lacks: the worker's
test imports it where it runs, so the layout and staging tests run there anyway.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
import torch

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.connector.vllm.kv_layout import group_layout
from kvpipe.connector.vllm.settings import settings_from
from kvpipe.connector.vllm.staging_area import StagingArea
from kvpipe.stages import LoadRequest, SaveRequest

from ...stages.kv_fixtures import chain_hashes
from .caches import engine_cache

if TYPE_CHECKING:
    from kvpipe.connector.vllm.worker import WorkerSide

#: vLLM 0.32's KVCacheLayout members: logical axis -> physical position
ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
SHAPE = {"L": 3, "B": 6, "H": 2, "N": 16, "C": 64}  # C in bf16 elements: K and V of a 32-wide head
BLOCK = SHAPE["N"]
BITS = torch.int16  # random bits make NaNs of bfloat16: compare the bits
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def layout_views(
    name: str, device: str, seed: int = 0, shape: Mapping[str, int] = SHAPE
) -> dict[str, torch.Tensor]:
    """One ``[B, H, N, C]`` bf16 view per layer of a ``shape`` cache laid out as ``name``, random bits in it."""
    order = ORDERS[name]
    logical = [shape[axis] for axis in "LBHNC"]
    physical = [logical[axis] for axis in order]
    generator = torch.Generator().manual_seed(seed)
    raw = (
        torch.randint(-30000, 30000, physical, dtype=BITS, generator=generator)
        .to(device)
        .view(torch.bfloat16)
    )
    inverse = sorted(range(5), key=lambda axis: order[axis])
    cache = raw.permute(inverse)  # logical [L, B, H, N, C] over the physical memory
    return {f"layer.{layer}": cache[layer] for layer in range(shape["L"])}


@pytest.mark.parametrize("name", list(ORDERS))
def test_the_hand_made_views_are_the_views_vllm_makes(name: str) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from .test_kv_layout import engine_views

    ours = layout_views(name, "cpu")
    theirs = engine_views(KVCacheLayout[name])  # test_kv_layout's spec: the same geometry
    assert [v.shape for v in ours.values()] == [v.shape for v in theirs.values()]
    assert [v.stride() for v in ours.values()] == [v.stride() for v in theirs.values()]


def worker(store: MemoryStore, name: str, device: str, settings: Mapping[str, object] | None = None) -> WorkerSide:
    if device == "cuda":  # make gpu-check's bare python3 has no vLLM; .venv has it, so a broken one fails
        pytest.importorskip("vllm")
    from kvpipe.connector.vllm.worker import WorkerSide

    layers = tuple(f"layer.{layer}" for layer in range(SHAPE["L"]))
    cache = engine_cache(layers, block_size=BLOCK, num_blocks=SHAPE["B"], layout_name=name)
    connector = settings_from({"store": {"kind": "memory"}, "staging_blocks": 8, **(settings or {})})
    return WorkerSide(cache, connector, store)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ORDERS))
def test_staging_copies_a_block_out_and_back_on_the_caches_device(name: str, device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    source, target = layout_views(name, device, seed=1), layout_views(name, device, seed=2)
    area = StagingArea({0: (group_layout(source, SHAPE["B"], name),)}, slots=2)
    assert area.arena.is_pinned() == (device != "cpu")
    area.copy_in([(0, 1, 4)]).wait()
    back = StagingArea({0: (group_layout(target, SHAPE["B"], name),)}, slots=2)
    back.arena.copy_(area.arena)
    back.copy_out([(0, 1, 0)])  # ordered before what the current stream runs next: the reads below
    for layer in source:
        assert torch.equal(target[layer][0].view(BITS).cpu(), source[layer][4].view(BITS).cpu())


@pytest.mark.gpu
def test_a_device_save_copy_waits_for_the_forward_on_the_device_not_on_the_engine_thread() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    source = layout_views("LBHNC", "cuda")
    area = StagingArea({0: (group_layout(source, SHAPE["B"], "LBHNC"),)}, slots=2)
    torch.cuda._sleep(1 << 30)  # a forward still running on the engine's stream (~0.5 s)
    fence = area.copy_in([(0, 1, 4)])
    assert not fence.done()  # copy_in returned; its copy is queued behind the forward
    fence.wait()
    expected = torch.cat([view[4].contiguous().view(torch.uint8).flatten().cpu() for view in source.values()])
    assert torch.equal(area.arena.view(2, -1)[1], expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ORDERS))
def test_the_worker_saves_and_loads_a_cache_on_its_device(name: str, device: str) -> None:
    """On a device the loads land in host slots first (a GPU cache is not registrable memory)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    store = MemoryStore(16 << 20)
    hashes = chain_hashes(2, salt=name)
    source, target = layout_views(name, device, seed=3), layout_views(name, device, seed=4)
    saver = worker(store, name, device)
    saver.register_kv_caches(source)
    saver.wait_for_save(SimpleNamespace(saves=[SaveRequest("s", hashes, ((5, 2),), 2 * BLOCK)]))
    assert saver.drain(10.0) and saver.stats["objects_put"] == 2
    loader = worker(store, name, device)
    loader.register_kv_caches(target)
    assert loader._load_via_staging  # the default, on any device
    loader.start_load_kv(
        SimpleNamespace(loads=[LoadRequest("l", hashes, ((1, 3),), 0, 2 * BLOCK)], sync_loads=set())
    )
    deadline = time.monotonic() + 10
    while not (finished := loader.get_finished()) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert finished == {"l"} and loader.get_block_ids_with_load_errors() == set()
    for layer in source:
        for saved, loaded in ((5, 1), (2, 3)):
            assert torch.equal(target[layer][loaded].view(BITS).cpu(), source[layer][saved].view(BITS).cpu())
    saver.shutdown(owns_store=False)
    loader.shutdown(owns_store=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ORDERS))
def test_the_worker_saves_and_loads_a_cache_layer_by_layer_on_its_device(name: str, device: str) -> None:
    """``save_layerwise`` and ``load_layerwise``: each layer copied after its attention, and in before it.

    On a device each layer's copy runs on the side stream and the engine's stream
    waits for that copy's event only, before its next kernel: the reads below.
    """
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    layerwise = {"save_layerwise": True, "load_layerwise": True}
    store = MemoryStore(16 << 20)
    hashes = chain_hashes(2, salt=f"layers-{name}")
    source, target = layout_views(name, device, seed=5), layout_views(name, device, seed=6)
    saver = worker(store, name, device, layerwise)
    saver.register_kv_caches(source)
    save = SimpleNamespace(saves=[SaveRequest("s", hashes, ((5, 2),), 2 * BLOCK)], loads=[], sync_loads=set())
    saver.start_layered_saves(save)
    for layer in source:
        saver.save_kv_layer(layer)
    saver.wait_for_save(save)
    assert saver.drain(10.0) and (saver.stats["saves_layered"], saver.stats["objects_put"]) == (1, 2)
    loader = worker(store, name, device, layerwise)
    loader.register_kv_caches(target)
    load = SimpleNamespace(loads=[LoadRequest("l", hashes, ((1, 3),), 0, 2 * BLOCK)], sync_loads={"l"}, saves=[])
    loader.start_load_kv(load)
    for layer in source:
        loader.wait_for_layer_load(layer)
        for saved, loaded in ((5, 1), (2, 3)):
            assert torch.equal(target[layer][loaded].view(BITS).cpu(), source[layer][saved].view(BITS).cpu())
    loader.wait_for_save(load)
    assert loader.get_block_ids_with_load_errors() == set() and loader.stats["loads_layered"] == 1
    saver.shutdown(owns_store=False)
    loader.shutdown(owns_store=False)
