"""The worker's layer-wise loads on vLLM's own KV views, every layout, driven as vLLM drives them.

vLLM binds the step's metadata, calls ``start_load_kv``, then before each
attention layer ``wait_for_layer_load(layer)``, and at the step's end
``wait_for_save`` and ``get_block_ids_with_load_errors``. No engine runs: the
views are what vLLM's ``create_kv_cache_views`` makes and the store is the
in-process model (``test_layerwise_loads.py`` runs the real engine).
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.connector.vllm.messages import KVPipeMetadata
from kvpipe.connector.vllm.worker import WorkerSide
from kvpipe.stages import LoadRequest, SaveRequest
from kvpipe.stages.keys import is_object_key

from ...stages.stores import StalledRanges
from .test_kv_layout import LAYERS, engine_views
from .test_worker_side import BITS, BLOCK, GIVEN_UP, HASHES, QUICK_DEADLINE, save_three_blocks, worker
from .vllm_step import run_step

LAYERWISE = {"load_layerwise": True}
LOAD = LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)  # the chunks saved from blocks 4, 1, 5
SAVED_FROM = ((4, 0), (1, 2), (5, 3))  # (source block, target block)


def _loader(
    store: MemoryStore, layout: KVCacheLayout, settings: dict | None = None, *, layer_seals: bool = True
) -> tuple[WorkerSide, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Three blocks saved (by a layer-wise writer, which leaves layer seals, unless not ``layer_seals``),
    and a layer-wise loader over fresh memory: (it, the source views, its views)."""
    source = save_three_blocks(store, layout, LAYERWISE if layer_seals else None)
    target = engine_views(layout)
    loader = worker(store, layout, {**LAYERWISE, **(settings or {})})
    loader.register_kv_caches(target)
    return loader, source, target


def _layer_in(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor], name: str) -> bool:
    return all(torch.equal(target[name][loaded].view(BITS), source[name][saved].view(BITS)) for saved, loaded in SAVED_FROM)


@pytest.mark.parametrize("via_staging", [False, True], ids=["into-blocks", "via-staging"])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_each_layer_is_in_the_engines_blocks_when_its_wait_returns(layout: KVCacheLayout, via_staging: bool) -> None:
    loader, source, target = _loader(MemoryStore(16 << 20), layout, {"load_via_staging": via_staging})
    meta = KVPipeMetadata(loads=[LOAD], sync_loads={"l"})
    loader.start_load_kv(meta)

    landed = []
    for name in LAYERS:
        loader.wait_for_layer_load(name)
        landed.append(_layer_in(source, target, name))
    loader.wait_for_save(meta)

    assert landed == [True] * len(LAYERS)
    assert loader.get_block_ids_with_load_errors() == set()
    assert (loader.stats["loads_layered"], loader.stats["chunks_loaded"], loader.stats["loads_layer_late"]) == (1, 3, 0)
    loader.shutdown(owns_store=False)


def test_objects_sealed_without_layer_seals_load_verified_whole() -> None:
    """Their writer knew no layers: each is read whole and judged before the forward, as a whole load would."""
    loader, source, target = _loader(MemoryStore(16 << 20), KVCacheLayout.LBHNC, layer_seals=False)

    run_step(loader, KVPipeMetadata(loads=[LOAD], sync_loads={"l"}), LAYERS)

    assert all(_layer_in(source, target, name) for name in LAYERS)
    assert loader.get_block_ids_with_load_errors() == set() and loader.stats["chunks_verified"] == 3
    loader.shutdown(owns_store=False)


def test_a_layer_the_forward_never_waited_for_fails_the_load_whole_in_its_step() -> None:
    loader, _, _ = _loader(MemoryStore(16 << 20), KVCacheLayout.LBHNC)

    run_step(loader, KVPipeMetadata(loads=[LOAD], sync_loads={"l"}), LAYERS[:-1])

    assert loader.get_block_ids_with_load_errors() == GIVEN_UP
    assert loader.stats["loads_layer_late"] == 1
    loader.shutdown(owns_store=False)


def test_a_layer_late_past_the_deadline_fails_the_load_whole_and_never_reaches_the_blocks() -> None:
    store = StalledRanges(after=1)  # the first layer lands, the second hangs
    loader, source, target = _loader(store, KVCacheLayout.LBHNC, QUICK_DEADLINE)
    meta = KVPipeMetadata(loads=[LOAD], sync_loads={"l"})
    before = target[LAYERS[1]][list(GIVEN_UP)].clone()

    run_step(loader, meta, LAYERS)

    assert _layer_in(source, target, LAYERS[0])
    assert torch.equal(target[LAYERS[1]][list(GIVEN_UP)].view(BITS), before.view(BITS))
    assert loader.get_block_ids_with_load_errors() == GIVEN_UP
    assert (loader.stats["loads_layer_late"], loader.stats["loads_given_up"]) == (1, 1)
    store.let_go.set()
    loader.shutdown(owns_store=False)


def test_an_async_load_stays_async() -> None:
    loader, _, _ = _loader(MemoryStore(16 << 20), KVCacheLayout.LBHNC)

    run_step(loader, KVPipeMetadata(loads=[LOAD]), LAYERS)

    assert loader.stats["loads_layered"] == 0
    loader.shutdown(owns_store=False)


@pytest.mark.parametrize("settings", [LAYERWISE, {}], ids=["layer-wise", "whole"])
def test_a_request_whose_load_failed_in_the_step_saves_nothing_the_step_computed(settings: dict) -> None:
    """Its blocks held no right bytes when the forward read them: what it computed over them is recomputed."""
    store = MemoryStore(16 << 20)
    loader = worker(store, KVCacheLayout.LBHNC, settings)
    loader.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    missing = LoadRequest("r", HASHES, ((0, 2, 3),), 0, 2 * BLOCK)  # nothing is stored
    save = SaveRequest("r", HASHES, ((0, 2, 3),), 3 * BLOCK, 2 * BLOCK)

    run_step(loader, KVPipeMetadata(loads=[missing], sync_loads={"r"}, saves=[save]), LAYERS)

    assert loader.drain(10.0)
    assert loader.get_block_ids_with_load_errors() == {0, 2}
    assert (loader.stats["saves_dropped_failed_load"], loader.stats["objects_put"]) == (1, 0)
    loader.shutdown(owns_store=False)


@pytest.mark.parametrize(
    "layout", [layout for layout in KVCacheLayout if not layout.is_block_outermost], ids=lambda m: m.name
)
def test_through_the_staging_slots_a_layer_reaches_the_blocks_only_when_its_wait_returns(layout: KVCacheLayout) -> None:
    """Each wait copies home its own layer (a cross-layer block is one region: it goes home whole, first)."""
    loader, source, target = _loader(MemoryStore(16 << 20), layout)
    meta = KVPipeMetadata(loads=[LOAD], sync_loads={"l"})
    loader.start_load_kv(meta)

    home = []
    for name in LAYERS:
        loader.wait_for_layer_load(name)
        home.append([_layer_in(source, target, layer) for layer in LAYERS])
    loader.wait_for_save(meta)

    assert home == [[True, False, False], [True, True, False], [True, True, True]]
    loader.shutdown(owns_store=False)


# -- layer-wise saves ------------------------------------------------------------------------

SAVE = SaveRequest("s", HASHES, ((4, 1, 5),), 3 * BLOCK)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_blocks_saved_layer_by_layer_are_the_objects_a_whole_save_stores(layout: KVCacheLayout) -> None:
    views = engine_views(layout)
    whole, layered = MemoryStore(16 << 20), MemoryStore(16 << 20)
    for store, settings in ((whole, {}), (layered, {"save_layerwise": True})):
        saver = worker(store, layout, settings)
        saver.register_kv_caches(views)
        run_step(saver, KVPipeMetadata(saves=[SAVE]), LAYERS)
        assert saver.drain(10.0)
        saver.shutdown(owns_store=False)

    assert (saver.stats["saves_layered"], saver.stats["objects_put"]) == (1, 3)
    assert _stored(layered) == _stored(whole)


def test_a_layer_wise_save_is_invisible_until_its_step_ends() -> None:
    store = MemoryStore(16 << 20)
    saver = worker(store, KVCacheLayout.LBHNC, {"save_layerwise": True})
    saver.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    meta = KVPipeMetadata(saves=[SAVE])
    saver.submit_loads(meta)
    saver.start_layered_saves(meta)
    for name in LAYERS:
        saver.save_kv_layer(name)

    assert saver.drain(0.2) is False  # every layer written, waiting for the step's end
    assert _stored(store) == {}
    saver.wait_for_save(meta)
    assert saver.drain(10.0)
    assert len(_stored(store)) == 3
    saver.shutdown(owns_store=False)


def test_a_layer_wise_save_of_a_request_whose_load_failed_in_the_step_is_revoked_unseen() -> None:
    store = MemoryStore(16 << 20)
    saver = worker(store, KVCacheLayout.LBHNC, {"save_layerwise": True})
    saver.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    missing = LoadRequest("s", HASHES, ((4, 1, 5),), 0, BLOCK)  # nothing is stored: it fails

    run_step(saver, KVPipeMetadata(loads=[missing], sync_loads={"s"}, saves=[SAVE]), LAYERS)

    assert saver.drain(10.0)
    assert _stored(store) == {}
    assert (saver.stats["saves_dropped_failed_load"], saver.stats["object_failures_called_off"]) == (1, 3)
    saver.shutdown(owns_store=False)


def _stored(store: MemoryStore) -> dict[str, bytes]:
    """Every object (seals aside) the store holds, by key."""
    return {key: bytes(obj.data) for key, obj in store._objects.items() if is_object_key(key)}


def test_a_worker_shut_down_mid_step_calls_its_layer_wise_saves_off() -> None:
    store = MemoryStore(16 << 20)
    saver = worker(store, KVCacheLayout.LBHNC, {"save_layerwise": True})
    saver.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    meta = KVPipeMetadata(saves=[SAVE])
    saver.submit_loads(meta)
    saver.start_layered_saves(meta)
    saver.save_kv_layer(LAYERS[0])

    saver.shutdown(owns_store=False)  # the step never ends

    assert _stored(store) == {}
    assert saver.stats["object_failures_called_off"] == 3
