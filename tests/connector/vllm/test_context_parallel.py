"""PCP and DCP ranks in keys, lookups and block sizes, as vLLM 0.32's ``MooncakeStoreConnector`` has them.

The oracle is vLLM's own code run without an engine: its worker's
``_init_lookup_key_prefixes`` (what a hit needs), ``PoolKey.build_prefix`` (a
rank's keys) and ``resolve_dcp_kv_block_size`` (the span of a block under DCP).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    KeyMetadata,
    PoolKey,
    RankLocalStoreLayout,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker
from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
)

from kvpipe.connector.vllm.engine_cache import groups_of
from kvpipe.stages.keys import object_key_prefix

from .caches import engine_cache

#: (tp, pcp, dcp, pp, TP ranks per copy): plain TP, PCP, DCP, both, with PP, replicated heads
LAYOUTS = [
    (2, 1, 1, 1, 1),
    (2, 2, 1, 1, 1),
    (4, 1, 2, 1, 1),
    (4, 2, 2, 2, 1),
    (1, 4, 1, 2, 1),
    (4, 2, 1, 1, 2),  # GQA with 2 heads at TP 4: two ranks per copy
]


def vllms_lookup_prefixes(tp: int, pcp: int, dcp: int, pp: int, factor: int) -> set[str]:
    worker: Any = SimpleNamespace(
        tp_size=tp,
        pcp_size=pcp,
        dcp_size=dcp,
        pp_size=pp,
        token_dbs=[SimpleNamespace(store_layout=RankLocalStoreLayout(KeyMetadata("m", 0, 0, 0, 0), 16, 16))],
        _group_tp_replication_factors=(factor,),
    )
    MooncakeStoreWorker._init_lookup_key_prefixes(worker)
    (prefixes,) = worker._lookup_key_prefixes
    assert len(set(prefixes)) == len(prefixes)
    return set(prefixes)


@pytest.mark.parametrize(("tp", "pcp", "dcp", "pp", "factor"), LAYOUTS)
def test_a_hit_needs_the_objects_of_every_rank_vllms_connector_asks_for(
    tp: int, pcp: int, dcp: int, pp: int, factor: int
) -> None:
    cache = engine_cache(tp_size=tp, tp_replicas=factor, pcp_size=pcp, dcp_size=dcp, pp_size=pp)
    ours = [object_key_prefix(namespace, 0)[:-1] for namespace in cache.chunk_namespaces]
    assert len(set(ours)) == len(ours)
    assert set(ours) == vllms_lookup_prefixes(tp, pcp, dcp, pp, factor)


@pytest.mark.parametrize(("tp", "pcp", "dcp", "pp", "factor"), LAYOUTS)
def test_each_rank_keys_its_objects_as_vllms_connector_does(
    tp: int, pcp: int, dcp: int, pp: int, factor: int
) -> None:
    for pcp_rank in range(pcp):
        cache = engine_cache(
            tp_size=tp, tp_replicas=factor, pcp_size=pcp, pcp_rank=pcp_rank, dcp_size=dcp, pp_size=pp
        )
        for tp_rank in range(tp):
            (namespace,) = cache.rank_namespaces(tp_rank)
            dcp_rank = tp_rank % dcp if dcp > 1 else 0
            metadata = KeyMetadata("m", tp_rank // factor, pcp_rank, dcp_rank, 0)
            assert object_key_prefix(namespace, 0)[:-1] == PoolKey.build_prefix(metadata)


def test_under_dcp_an_attention_block_spans_every_dcp_ranks_tokens_and_a_mamba_state_does_not() -> None:
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    latent = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=96, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=64, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align")
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate((attention, latent, mamba))]
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups, hash_block_size=16)
    ours = [group.block_size for group in groups_of(config, "align", dcp_size=4)]
    assert ours == [resolve_dcp_kv_block_size(g.kv_cache_spec, 4) for g in groups] == [64, 64, 64]
    assert [group.block_size for group in groups_of(config, "align")] == [16, 16, 64]
