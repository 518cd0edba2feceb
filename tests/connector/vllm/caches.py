"""The engine cache the connector's sides see, for tests that drive them without an engine."""

from __future__ import annotations

from collections.abc import Sequence

from kvpipe.connector.vllm.engine_cache import EngineCache
from kvpipe.connector.vllm.store_format import EngineShape, store_format
from kvpipe.stages import GroupKind, GroupSpec


def engine_cache(
    layers: Sequence[str] = ("layer",),
    *,
    groups: Sequence[GroupSpec] | None = None,
    block_size: int = 16,
    num_blocks: int = 64,
    layout_name: str = "LBHNC",
    model: str = "m",
    tp_size: int = 1,
    tp_replicas: int = 1,
    hash_block_size: int | None = None,
    hit_alignment: int | None = None,
    store_tp_size: int | None = None,
    kv_heads: int = 8,
    pcp_size: int = 1,
    pcp_rank: int = 0,
    dcp_size: int = 1,
    pp_size: int = 1,
) -> EngineCache:
    """One full-attention group over ``layers`` unless ``groups`` are given (each over ``layers``).

    ``store_tp_size``: the store format vLLM's connector would pick for it over ``kv_heads`` heads.
    """
    specs = tuple(groups) if groups is not None else (GroupSpec(GroupKind.FULL_ATTENTION, block_size),)
    plain = len(specs) == 1 and specs[0].kind is GroupKind.FULL_ATTENTION
    shape = EngineShape(
        tp_size, pp_size, kv_heads, layout_name, plain, context_parallel=(pcp_size, dcp_size) != (1, 1)
    )
    return EngineCache(
        groups=specs,
        hash_block_size=hash_block_size or block_size,
        model=model,
        cache_prefix="",
        tp_size=tp_size,
        pp_rank=0,
        layer_names=tuple(tuple(layers) for _ in specs),
        num_blocks=num_blocks,
        layout_name=layout_name,
        tp_replicas=tp_replicas,
        hit_alignment=hit_alignment,
        store_format=store_format(store_tp_size, shape),
        pp_size=pp_size,
        pcp_size=pcp_size,
        pcp_rank=pcp_rank,
        dcp_size=dcp_size,
    )
