"""Heterogeneous TP: the store format vLLM's connector picks, its keys, and each store shard's bytes.

The oracle is vLLM 0.32's own ``MooncakeStoreConnector``: its worker's
``_select_store_layout`` for the choice, ``PoolKey``/``_make_mooncake_group_id`` for
names, and ``LBHNCStoreLayout``/``LBNHCStoreLayout`` for the bytes of a shard's
object, all run on CPU tensors made by vLLM's ``create_kv_cache_views``.
"""

from __future__ import annotations

import ctypes
import dataclasses
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    KeyMetadata,
    LBHNCStoreLayout,
    LBNHCStoreLayout,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    MooncakeStoreWorker,
    _make_mooncake_group_id,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvpipe.connector.vllm.kv_layout import LayoutError, shard_layouts
from kvpipe.connector.vllm.store_format import EngineShape, StoreFormat, store_format
from kvpipe.stages import GroupKind, GroupSpec, group_id, object_key

from .caches import engine_cache

NUM_BLOCKS = 5
BLOCK = 16
LAYERS = ("layer.0", "layer.1", "layer.2")
HEADS = 8  # in all, over every rank
ORACLES = {KVCacheLayout.LBHNC: LBHNCStoreLayout, KVCacheLayout.LBNHC: LBNHCStoreLayout}


class Case(NamedTuple):
    """One engine asking for a store TP size: the settings, its TP size, KV heads, layout, stored spec, DCP."""

    store_tp: dict[str, Any]
    tp: int
    heads: int
    layout: KVCacheLayout
    spec: Any
    dcp: int = 1


def vllms_choice(case: Case) -> tuple[int | None, str]:
    """What vLLM's worker picks (store TP size, namespace) for the engine, without building one."""
    worker: Any = SimpleNamespace(
        tp_size=case.tp,
        pp_size=1,
        num_kv_head=case.heads,
        pcp_size=1,
        dcp_size=case.dcp,
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: case.layout),
        _kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), case.spec)],
    )
    worker._supports_tp_sharded_store_layout = lambda cls, extra: (
        MooncakeStoreWorker._supports_tp_sharded_store_layout(worker, cls, extra)
    )
    size, namespace, _ = MooncakeStoreWorker._select_store_layout(worker, case.store_tp)
    return size, namespace


def ours(case: Case) -> StoreFormat:
    from kvpipe.connector.vllm.settings import settings_from

    settings = settings_from(case.store_tp)
    engine = EngineShape(
        tp_size=case.tp,
        pp_size=1,
        kv_heads=case.heads,
        layout_name=case.layout.name,
        one_plain_attention_group=type(case.spec) is FullAttentionSpec,
        context_parallel=case.dcp > 1,
        cross_layer_blocks=settings.enable_cross_layers_blocks,
    )
    return store_format(settings.requested_store_tp_size(), engine, settings.store_tp_topology())


ATTENTION = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=32, dtype=torch.bfloat16)
CHOICES = [
    Case({"store_tp_size": 4}, 2, 8, KVCacheLayout.LBHNC, ATTENTION, 1),  # sharded, 2 shards a rank
    Case({"store_tp_size": 4}, 4, 8, KVCacheLayout.LBHNC, ATTENTION, 1),
    Case({"store_tp_size": 4}, 1, 8, KVCacheLayout.LBNHC, ATTENTION, 1),  # sharded over tokens
    Case({"enable_store_tp_lcm": True, "prefill_tp_sizes": [2, 4]}, 2, 8, KVCacheLayout.LBHNC, ATTENTION, 1),
    Case({"enable_store_tp_lcm": True, "prefill_tp_sizes": [2, 3]}, 2, 12, KVCacheLayout.LBHNC, ATTENTION, 1),
    Case({"store_tp_size": 4}, 2, 1, KVCacheLayout.LBHNC, ATTENTION, 1),  # one KV head: replicated MQA
    Case({"store_tp_size": 4}, 2, 6, KVCacheLayout.LBHNC, ATTENTION, 1),  # heads do not divide: compatibility
    Case({"store_tp_size": 2}, 4, 8, KVCacheLayout.LBHNC, ATTENTION, 1),  # below the engine's TP
    Case({"store_tp_size": 4}, 2, 8, KVCacheLayout.LHBNC, ATTENTION, 1),  # a layout that cannot shard
    Case({"store_tp_size": 4}, 2, 8, KVCacheLayout.BLHNC, ATTENTION, 1),  # cross-layer blocks
    Case({"store_tp_size": 4}, 2, 8, KVCacheLayout.LBHNC, ATTENTION, 2),  # DCP
    Case({"store_tp_size": 4, "enable_cross_layers_blocks": "True"}, 2, 8, KVCacheLayout.LBHNC, ATTENTION, 1),
    Case(
        {"store_tp_size": 2},
        2,
        1,
        KVCacheLayout.LBHNC,
        MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=96, dtype=torch.bfloat16),
        1,
    ),
    Case(
        {"store_tp_size": 4},
        2,
        8,
        KVCacheLayout.LBHNC,
        SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=8, head_size=32, dtype=torch.bfloat16, sliding_window=64
        ),
        1,
    ),
]


@pytest.mark.parametrize("case", CHOICES)
def test_the_store_format_is_the_one_vllms_connector_picks(case: Case) -> None:
    chosen = ours(case)
    assert (chosen.store_tp_size, chosen.namespace) == vllms_choice(case)


def test_without_a_store_tp_size_keys_have_no_namespace() -> None:
    chosen = ours(Case({}, 2, 8, KVCacheLayout.LBHNC, ATTENTION))
    assert chosen == StoreFormat() and not chosen.sharded


def local_views(layout: KVCacheLayout, local_heads: int, seed: int) -> dict[str, torch.Tensor]:
    """One rank's per-layer views (its ``local_heads`` of the heads), as vLLM's worker makes them."""
    spec = dataclasses.replace(ATTENTION, num_kv_heads=local_heads)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, len(LAYERS), layout)
    size = layer_stride * len(LAYERS)
    raw = torch.randint(-128, 127, (size,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    tensor = KVCacheTensor(
        size=size, layers=list(LAYERS), layer_stride=layer_stride, block_stride=block_stride
    )
    return dict(zip(LAYERS, create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor), strict=True))


def read(addresses: list[int], sizes: list[int]) -> bytes:
    return b"".join(ctypes.string_at(address, size) for address, size in zip(addresses, sizes, strict=True))


@pytest.mark.parametrize("layout", list(ORACLES), ids=lambda m: m.name)
@pytest.mark.parametrize(("tp", "store_tp"), [(1, 2), (2, 4), (2, 2), (4, 8)])
def test_a_store_shards_object_is_the_bytes_vllms_connector_puts_for_it(
    layout: KVCacheLayout, tp: int, store_tp: int
) -> None:
    for tp_rank in range(tp):
        views = local_views(layout, HEADS // tp, seed=tp_rank)
        oracle = ORACLES[layout](
            KeyMetadata("m", tp_rank, 0, 0, 0),
            BLOCK,
            BLOCK,
            local_tp_size=tp,
            store_tp_size=store_tp,
            tp_rank=tp_rank,
            num_kv_heads=HEADS,
        )
        oracle.register_kv_caches(list(views.values()), NUM_BLOCKS)
        shards = shard_layouts(views, NUM_BLOCKS, BLOCK, store_tp // tp, layout.name)
        for local, shard_id in enumerate(oracle.local_shard_ids):
            for block in (0, 3, NUM_BLOCKS - 1):
                (addresses,), (sizes,), _ = oracle.prepare_values([(0, BLOCK)], [block], [shard_id])
                ours = shards[local].block_layout.buffers(block)
                assert read(*map(list, zip(*ours, strict=True))) == read(addresses, sizes)


def test_an_lbhnc_shard_is_one_run_per_layer_and_an_lbnhc_shard_one_per_token() -> None:
    lbhnc = shard_layouts(local_views(KVCacheLayout.LBHNC, 4, 0), NUM_BLOCKS, BLOCK, 2, "LBHNC")
    lbnhc = shard_layouts(local_views(KVCacheLayout.LBNHC, 4, 0), NUM_BLOCKS, BLOCK, 2, "LBNHC")
    assert [len(shard.regions) for shard in lbhnc] == [len(LAYERS)] * 2
    assert [len(shard.regions) for shard in lbnhc] == [len(LAYERS) * BLOCK] * 2


def test_shards_cover_a_ranks_block_once() -> None:
    views = local_views(KVCacheLayout.LBHNC, 4, 0)
    shards = shard_layouts(views, NUM_BLOCKS, BLOCK, 4, "LBHNC")
    assert sum(shard.object_size for shard in shards) == sum(
        v[0].numel() * v.element_size() for v in views.values()
    )


def test_heads_that_do_not_split_into_the_shards_are_refused() -> None:
    with pytest.raises(LayoutError, match=r"'layer\.0' \(LBHNC\): 4 KV heads cannot be split into 3"):
        shard_layouts(local_views(KVCacheLayout.LBHNC, 4, 0), NUM_BLOCKS, BLOCK, 3, "LBHNC")


def test_a_cache_of_another_shape_is_refused_for_sharding() -> None:
    flat = {name: view.flatten(1) for name, view in local_views(KVCacheLayout.LBHNC, 4, 0).items()}
    with pytest.raises(LayoutError, match=r"'layer\.0' \(LBHNC\) has shape .*store TP sharding needs"):
        shard_layouts(flat, NUM_BLOCKS, BLOCK, 2, "LBHNC")


def sharded_cache(tp: int, store_tp: int) -> Any:
    chosen = ours(Case({"store_tp_size": store_tp}, tp, HEADS, KVCacheLayout.LBHNC, ATTENTION))
    return dataclasses.replace(
        engine_cache(
            LAYERS, model="org/tiny", tp_size=tp, groups=[GroupSpec(GroupKind.FULL_ATTENTION, BLOCK)]
        ),
        store_format=chosen,
    )


def test_keys_and_group_ids_are_vllms_in_the_shared_namespace() -> None:
    cache = sharded_cache(tp=2, store_tp=4)
    chunk = bytes(range(32))
    for tp_rank in range(2):
        metadata = KeyMetadata("tiny", tp_rank, 0, 0, 0, store_namespace=cache.store_format.namespace)
        oracle = LBHNCStoreLayout(metadata, BLOCK, BLOCK, 2, 4, tp_rank, HEADS)
        for shard in cache.rank_keys(tp_rank):
            assert object_key(cache.namespace(shard), 0, chunk) == oracle.key_for(shard, chunk)
            assert group_id(cache.namespace(shard), chunk) == _make_mooncake_group_id(metadata, chunk.hex())


def test_a_rank_stores_its_own_shards_and_a_hit_needs_every_shard() -> None:
    cache = sharded_cache(tp=2, store_tp=4)
    assert [list(cache.rank_keys(rank)) for rank in range(2)] == [[0, 1], [2, 3]]
    assert all(cache.puts_from(rank) for rank in range(2))
    assert [shard.namespace.tp_rank for shard in cache.lookup_shards] == [0, 1, 2, 3]
    assert list(cache.writers) == [0, 1]
