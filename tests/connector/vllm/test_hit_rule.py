"""kvpipe's hit is the hit vLLM's own rule finds over the same stored objects.

vLLM's connector finds a hit with a mirror of the engine's prefix-cache rule
(``MooncakeStoreCoordinator`` over an ``ExternalCachedBlockPool``: which
``(group, block hash)`` pairs exist). Given the same stored chunks, kvpipe's
:class:`~kvpipe.stages.LookupPlan` must find the same hit for every group mix
the connector stores, with and without the engine recomputing the last block of
a hit (EAGLE, MTP), or the engine would load a block it means to recompute, or
miss one it could load.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.connector.vllm.engine_cache import groups_of, partial_hit_alignment
from kvpipe.stages import KVCache, LookupPlan, LookupRequest, object_key, storable_groups

from ...stages.kv_fixtures import chain_hashes, make_kv

HASH_BLOCK = 16


def _full(block_size: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)


def _window(block_size: int, window: int) -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=window
    )


def _mamba(block_size: int) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=block_size, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align")


#: (name, vLLM specs, whether hits may end inside a block): the group mixes kvpipe stores
MIXES = {
    "full": ([lambda: _full(16)], False),
    "full, blocks of 4 hash blocks": ([lambda: _full(64)], False),
    "full, partial hits": ([lambda: _full(64)], True),
    "full + window": ([lambda: _full(16), lambda: _window(16, 24)], False),
    "full + wide window": ([lambda: _full(16), lambda: _window(16, 56)], False),
    "full + window, two block sizes": ([lambda: _full(16), lambda: _window(32, 40)], False),
    "full + mamba": ([lambda: _full(16), lambda: _mamba(16)], False),
    "full + mamba, two block sizes": ([lambda: _full(16), lambda: _mamba(32)], False),
    "full + mamba, partial hits": ([lambda: _full(64), lambda: _mamba(64)], True),
}


def _kv_cache_config(specs: list[Any], alignment: int | None) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{g}"], spec) for g, spec in enumerate(specs)],
        hash_block_size=HASH_BLOCK,
    )
    config.cache_hit_alignment_tokens = alignment
    return config


def _vllm_hit(config: Any, eagle: bool, hashes: list[bytes], num_tokens: int, stored: set[tuple[int, bytes]]) -> int:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        ExternalCachedBlockPool,
        MooncakeStoreCoordinator,
    )
    from vllm.v1.core.kv_cache_utils import BlockHash

    unit = math.lcm(*(group.kv_cache_spec.block_size for group in config.kv_cache_groups))
    coordinator = MooncakeStoreCoordinator(
        config.kv_cache_groups,
        unit,
        HASH_BLOCK,
        use_eagle=eagle,
        enable_partial_hash_hits=config.cache_hit_alignment_tokens is not None,
    )
    pool = ExternalCachedBlockPool(HASH_BLOCK, stored)
    _, hit = coordinator.find_longest_cache_hit([BlockHash(h) for h in hashes], num_tokens - 1, pool)
    return int(hit)


def _kvpipe_hit(config: Any, eagle: bool, hashes: list[bytes], num_tokens: int, stored: set[tuple[int, bytes]]) -> int:
    groups = groups_of(config, "align")
    alignment = partial_hit_alignment(groups, config.cache_hit_alignment_tokens)
    fixture = make_kv(list(groups), hash_block_size=HASH_BLOCK, layers=1, num_blocks=2)
    kv = KVCache(groups, HASH_BLOCK, fixture.kv.shards, alignment)
    namespace = kv.shards[0].namespace
    stored_keys = {object_key(namespace, group, chunk_hash) for group, chunk_hash in stored}
    request = LookupRequest("r", tuple(hashes), num_tokens)
    plan = LookupPlan(storable_groups(kv), kv.shards, HASH_BLOCK, request, alignment, recomputes_last_block=eagle)
    return plan.hit({key: key in stored_keys for key in plan.keys})


@st.composite
def _stores(draw: st.DrawFn) -> tuple[str, bool, list[bytes], int, set[tuple[int, bytes]]]:
    """A group mix, EAGLE or not, a prompt, and which of its chunks each group has stored."""
    mix = draw(st.sampled_from(sorted(MIXES)))
    num_tokens = draw(st.integers(1, 200))
    hashes = list(chain_hashes(num_tokens // HASH_BLOCK, salt=str(draw(st.integers(0, 3)))))
    specs, partial = MIXES[mix]
    stored: set[tuple[int, bytes]] = set()
    for group, make_spec in enumerate(specs):
        block_size = make_spec().block_size
        step = HASH_BLOCK if partial else block_size
        ends = range(step, len(hashes) * HASH_BLOCK + 1, step)
        run = draw(st.integers(0, len(ends)))  # a stored prefix, then holes and islands
        for index, end in enumerate(ends):
            if index < run and draw(st.integers(0, 9)) > 0 or index >= run and draw(st.integers(0, 3)) == 0:
                stored.add((group, hashes[end // HASH_BLOCK - 1]))
    return mix, draw(st.booleans()), hashes, num_tokens, stored


@settings(max_examples=400, deadline=None)
@given(case=_stores())
def test_the_hit_is_the_one_vllms_rule_finds_over_the_same_stored_chunks(case):
    mix, eagle, hashes, num_tokens, stored = case
    specs, partial = MIXES[mix]
    config = _kv_cache_config([make() for make in specs], HASH_BLOCK if partial else None)

    assert _kvpipe_hit(config, eagle, hashes, num_tokens, stored) == _vllm_hit(
        config, eagle, hashes, num_tokens, stored
    )
