"""Engine KV tensors -> regions, on the views vLLM itself makes for every ``KVCacheLayout``.

The oracle is vLLM's own ``MooncakeStoreConnector`` value layout
(``RankLocalStoreLayout.register_kv_caches`` / ``prepare_value_for_block``): the
object kvpipe stores for a block must be the bytes vLLM's connector puts for it,
so the two share one cache. The views come from vLLM's ``create_kv_cache_views``
with the strides its KV-cache config gives each layout; all of it runs on CPU.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    KeyMetadata,
    RankLocalStoreLayout,
)

from kvpipe.connector.vllm.kv_layout import LayoutError, group_layout

try:  # vLLM 0.33 moved it to the KV-cache planning module
    from vllm.v1.core.kv_cache_planning import _get_kv_cache_bytes_per_block  # noqa: E402
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import _get_kv_cache_bytes_per_block  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

NUM_BLOCKS = 6
LAYERS = ("layer.0", "layer.1", "layer.2")
ATTENTION = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=96, dtype=torch.bfloat16)
#: layouts whose object vLLM's connector reads as H*L overlapping rows, each a whole
#: cross-layer block long (past the cache's end at the last block): not a value to share
VLLM_MISREADS = {KVCacheLayout.BHLNC}


def engine_views(layout: KVCacheLayout, spec=ATTENTION, layers=LAYERS) -> dict[str, torch.Tensor]:
    """The per-layer views vLLM's worker makes for one group under ``layout``, random bytes in them."""
    group = KVCacheGroupSpec(list(layers), spec)
    block_stride = _get_kv_cache_bytes_per_block([group], layout) if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, NUM_BLOCKS, len(layers), layout, fixed_strides=(None, block_stride, None, None, None)
    )
    size = max(layer_stride * len(layers), block_stride * NUM_BLOCKS)  # exact, as vLLM allocates it
    raw = torch.randint(-128, 127, (size,), dtype=torch.int8)
    tensor = KVCacheTensor(
        size=size, layers=list(layers), layer_stride=layer_stride, block_stride=block_stride
    )
    return dict(zip(layers, create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor), strict=True))


def read(buffers) -> bytes:
    return b"".join(ctypes.string_at(address, size) for address, size in buffers)


def vllm_object(views: dict[str, torch.Tensor], block: int) -> bytes:
    oracle = RankLocalStoreLayout(KeyMetadata("m", 0, 0, 0, 0), ATTENTION.block_size, ATTENTION.block_size)
    oracle.register_kv_caches(list(views.values()), NUM_BLOCKS)
    addresses, sizes = oracle.prepare_value_for_block(block)
    return read(zip(addresses, sizes, strict=True))


@pytest.mark.parametrize("layout", [m for m in KVCacheLayout if m not in VLLM_MISREADS], ids=lambda m: m.name)
def test_an_object_is_the_bytes_vllms_connector_puts_for_the_block(layout: KVCacheLayout) -> None:
    views = engine_views(layout)
    regions = group_layout(views, NUM_BLOCKS, layout.name).block_layout
    for block in range(NUM_BLOCKS):
        assert read(regions.buffers(block)) == vllm_object(views, block)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_an_object_round_trips_into_another_cache_of_the_same_layout(layout: KVCacheLayout) -> None:
    """Every byte of every layer's block goes into its object and comes back where it was."""
    source, target = engine_views(layout), engine_views(layout)
    source_layout = group_layout(source, NUM_BLOCKS, layout.name)
    target_layout = group_layout(target, NUM_BLOCKS, layout.name)
    object_bytes = torch.cat([region.rows[4] for region in source_layout.regions])
    assert object_bytes.numel() == source_layout.object_size
    offset = 0
    for region in target_layout.regions:
        region.rows[1].copy_(object_bytes[offset : offset + region.rows.shape[1]])
        offset += region.rows.shape[1]
    bits = torch.int16  # random bytes make NaNs of bfloat16: compare the bits
    for name in LAYERS:
        assert torch.equal(target[name][1].view(bits), source[name][4].view(bits))
        assert not torch.equal(target[name][2].view(bits), source[name][4].view(bits))


@pytest.mark.parametrize(
    ("layout", "regions"),
    [
        (KVCacheLayout.LBHNC, 3),  # a dense block per layer
        (KVCacheLayout.LBNHC, 3),
        (KVCacheLayout.LHBNC, 6),  # heads outside blocks: a region per head
        (KVCacheLayout.BLHNC, 1),  # cross-layer: one row holds every layer's block
        (KVCacheLayout.BLNHC, 1),
        (KVCacheLayout.BHLNC, 1),
    ],
    ids=lambda value: getattr(value, "name", str(value)),
)
def test_each_layout_has_the_fewest_regions_its_strides_allow(layout: KVCacheLayout, regions: int) -> None:
    views = engine_views(layout)
    layout_regions = group_layout(views, NUM_BLOCKS, layout.name).regions
    assert len(layout_regions) == regions
    assert sum(r.region.bytes_per_block for r in layout_regions) == len(LAYERS) * ATTENTION.page_size_bytes


def test_under_bhlnc_vllms_connector_reads_overlapping_whole_rows() -> None:
    """Why BHLNC is not oracle-equal: vLLM's connector makes H*L buffers per object, each a whole row."""
    views = engine_views(KVCacheLayout.BHLNC)
    oracle = RankLocalStoreLayout(KeyMetadata("m", 0, 0, 0, 0), 16, 16)
    oracle.register_kv_caches(list(views.values()), NUM_BLOCKS)
    row = len(LAYERS) * ATTENTION.page_size_bytes
    assert oracle.block_len == [row] * (len(LAYERS) * ATTENTION.num_kv_heads)
    assert group_layout(views, NUM_BLOCKS, "BHLNC").object_size == row


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda m: m.name)
def test_an_mla_latent_block_is_the_bytes_vllms_connector_puts(layout: KVCacheLayout) -> None:
    views = engine_views(layout, MLA)
    assert views["layer.0"].dim() in (3, 4)
    regions = group_layout(views, NUM_BLOCKS, layout.name).block_layout
    for block in (0, NUM_BLOCKS - 1):
        assert read(regions.buffers(block)) == vllm_object(views, block)


def test_a_mamba_layers_state_views_are_one_page() -> None:
    page = torch.zeros(NUM_BLOCKS, 1024, dtype=torch.uint8)
    conv = page[:, :256].view(torch.float32).view(NUM_BLOCKS, 4, 16)
    ssm = page[:, 256:].view(torch.float32).view(NUM_BLOCKS, 12, 16)
    (region,) = group_layout({"mamba.0": [conv, ssm]}, NUM_BLOCKS).regions
    assert (region.region.base, region.region.bytes_per_block) == (page.data_ptr(), 1024)


def test_state_views_outside_one_page_are_refused() -> None:
    conv = torch.zeros(NUM_BLOCKS, 64)
    ssm = torch.zeros(NUM_BLOCKS, 64)  # another allocation
    with pytest.raises(LayoutError, match="'mamba.0'.*do not share one page"):
        group_layout({"mamba.0": [conv, ssm]}, NUM_BLOCKS)


def test_a_block_that_is_neither_dense_nor_dense_per_head_is_refused_naming_layer_and_layout() -> None:
    views = engine_views(KVCacheLayout.LBHNC)
    halves = {name: view[..., : view.shape[-1] // 2] for name, view in views.items()}
    with pytest.raises(LayoutError, match=r"'layer\.0' \(LBHNC\).*neither one dense run"):
        group_layout(halves, NUM_BLOCKS, "LBHNC")


def test_a_cache_without_the_block_dimension_first_is_refused() -> None:
    views = engine_views(KVCacheLayout.LBHNC)
    swapped = {name: view.transpose(0, 1) for name, view in views.items()}
    with pytest.raises(LayoutError, match=r"'layer\.0' \(LBHNC\) has shape \(2, 6, .*block dimension"):
        group_layout(swapped, NUM_BLOCKS, "LBHNC")


def test_layers_whose_blocks_overlap_are_refused() -> None:
    views = engine_views(KVCacheLayout.LBHNC)
    same = views["layer.0"]
    shifted = torch.as_strided(same, same.shape, same.stride(), same.storage_offset() + 64)
    with pytest.raises(LayoutError, match="overlap or step differently"):
        group_layout({"a": same, "b": shifted}, NUM_BLOCKS, "LBHNC")


def test_a_padded_row_that_runs_past_its_storage_is_refused() -> None:
    """64 bytes every 128: the last block's row would read 64 bytes beyond the allocation."""
    storage = torch.zeros((NUM_BLOCKS - 1) * 128 + 64, dtype=torch.uint8)
    layer = torch.as_strided(storage, (NUM_BLOCKS, 64), (128, 1))
    with pytest.raises(LayoutError, match="run past the end"):
        group_layout({"a": layer}, NUM_BLOCKS)


def test_no_tensor_for_the_stored_layers_is_refused() -> None:
    with pytest.raises(LayoutError, match="no KV cache tensor"):
        group_layout({}, NUM_BLOCKS, "LBHNC")
