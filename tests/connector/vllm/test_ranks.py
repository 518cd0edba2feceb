"""Two TP ranks as two worker halves in two processes, on one real master.

vLLM's CPU build hangs at TP=2 here (docs/vllm-connector.md, "Hybrid, sliding-window and MLA models, TP ranks"), so
each rank's worker side runs in a process of its own (:mod:`.rank_half`) and the
scheduler side asks the master what a TP=2 engine's scheduler would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpipe.connector.vllm.engine_cache import open_store, tp_replicas
from kvpipe.connector.vllm.scheduler import SchedulerSide
from kvpipe.connector.vllm.settings import settings_from
from kvpipe.stages import GROUP_ID_SCOPE
from kvpipe.stages.errors import ConfigError

from ...stages.kv_fixtures import chain_hashes
from .rank_half import BLOCK, CHUNKS, ranked_cache

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.mooncake


def rank(
    store: dict[str, Any],
    tp_rank: int,
    action: str,
    seed: int,
    replicas: int = 1,
    tp_size: int = 2,
    store_tp_size: int | None = None,
    dcp_size: int = 1,
    layerwise: bool = False,
) -> dict[str, Any]:
    spec = {
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "tp_replicas": replicas,
        "store": store,
        "action": action,
        "seed": seed,
        "store_tp_size": store_tp_size,
        "dcp_size": dcp_size,
        "layerwise": layerwise,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.connector.vllm.rank_half", json.dumps(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def hit_tokens(
    store_section: dict[str, Any],
    seed: int,
    replicas: int = 1,
    tp_size: int = 2,
    store_tp_size: int | None = None,
    dcp_size: int = 1,
) -> int:
    """What a TP=``tp_size`` engine's scheduler side finds stored for the request the halves saved."""
    settings = settings_from({"store": store_section})
    cache = ranked_cache(tp_size, replicas, store_tp_size, dcp_size)
    store, _ = open_store(settings, mount_segment=False)
    try:
        side = SchedulerSide(cache, settings, store)
        hashes = chain_hashes(CHUNKS, salt=f"ranks-{seed}")
        request = SimpleNamespace(request_id="r", block_hashes=hashes, num_tokens=CHUNKS * BLOCK + 1)
        new, _ = side.get_num_new_matched_tokens(request, 0)
        return new or 0
    finally:
        store.close()


def test_a_chunk_is_a_hit_only_when_every_rank_stored_it(store_section: dict[str, Any]) -> None:
    first = rank(store_section, 0, "save", seed=1)
    assert hit_tokens(store_section, seed=1) == 0  # rank 1's objects are missing
    second = rank(store_section, 1, "save", seed=1)
    assert hit_tokens(store_section, seed=1) == CHUNKS * BLOCK
    keys = [key for key, _ in first["put"]] + [key for key, _ in second["put"]]
    assert {key.split("@")[1] for key in keys} == {"tp_rank:0", "tp_rank:1"}  # ranks stay in the key
    by_chunk: dict[str, set[str]] = {}
    for key, group_id in first["put"] + second["put"]:
        by_chunk.setdefault(key.rsplit("@", 1)[1], set()).add(group_id)
    assert len(by_chunk) == CHUNKS
    for chunk, group_ids in by_chunk.items():  # one group id per chunk, across ranks
        assert group_ids == {f"{GROUP_ID_SCOPE}:ranked@{chunk}"}


def test_each_rank_loads_its_own_shard_back(store_section: dict[str, Any]) -> None:
    rank(store_section, 0, "save", seed=2)
    rank(store_section, 1, "save", seed=2)
    for tp_rank in (0, 1):
        loaded = rank(store_section, tp_rank, "load", seed=2)
        assert loaded == {"failed_blocks": [], "identical": True}


def test_a_replicated_latent_is_stored_once_under_rank_0_and_every_rank_loads_it(
    store_section: dict[str, Any],
) -> None:
    """MLA: the latent is the same on every rank: one copy, keyed tp_rank:0."""
    assert rank(store_section, 1, "save", seed=3, replicas=2)["put"] == []  # a replica puts nothing
    put = rank(store_section, 0, "save", seed=3, replicas=2)["put"]
    assert len(put) == CHUNKS and all("@tp_rank:0@" in key for key, _ in put)
    assert hit_tokens(store_section, seed=3, replicas=2) == CHUNKS * BLOCK
    assert rank(store_section, 1, "load", seed=3, replicas=2) == {"failed_blocks": [], "identical": True}


SHARED = "@store_tp:4@store_pp:1@store_format:tp_shared_lbhnc"  # store_tp_size 4 over LBHNC


def test_a_tp4_prefill_stores_head_shards_that_a_tp2_decode_loads(store_section: dict[str, Any]) -> None:
    """store_tp_size 4: a TP 4 rank puts its one shard, a TP 2 rank loads the two its heads cover."""
    puts = [rank(store_section, r, "save", seed=4, tp_size=4, store_tp_size=4)["put"] for r in range(4)]
    assert [{key.split("@tp_rank:")[1].split("@")[0] for key, _ in put} for put in puts] == [
        {"0"},
        {"1"},
        {"2"},
        {"3"},
    ]
    assert all(key.startswith(f"ranked{SHARED}@") for put in puts for key, _ in put)
    assert {group for put in puts for _, group in put} == {
        f"{GROUP_ID_SCOPE}:ranked{SHARED}@{key.rsplit('@', 1)[1]}" for key, _ in puts[0]
    }
    assert hit_tokens(store_section, seed=4, tp_size=2, store_tp_size=4) == CHUNKS * BLOCK
    for tp_rank in (0, 1):
        loaded = rank(store_section, tp_rank, "load", seed=4, tp_size=2, store_tp_size=4)
        assert loaded == {"failed_blocks": [], "identical": True}


def test_a_tp2_rank_stores_two_shards_that_tp4_ranks_load_one_by_one(store_section: dict[str, Any]) -> None:
    for tp_rank in (0, 1):
        assert (
            len(rank(store_section, tp_rank, "save", seed=5, tp_size=2, store_tp_size=4)["put"]) == 2 * CHUNKS
        )
    assert hit_tokens(store_section, seed=5, tp_size=4, store_tp_size=4) == CHUNKS * BLOCK
    for tp_rank in range(4):
        loaded = rank(store_section, tp_rank, "load", seed=5, tp_size=4, store_tp_size=4)
        assert loaded == {"failed_blocks": [], "identical": True}


def test_a_sharded_chunk_is_a_hit_only_when_every_store_shard_exists(store_section: dict[str, Any]) -> None:
    for tp_rank in range(3):
        rank(store_section, tp_rank, "save", seed=6, tp_size=4, store_tp_size=4)
    assert hit_tokens(store_section, seed=6, tp_size=2, store_tp_size=4) == 0  # shard 3 is missing
    assert hit_tokens(store_section, seed=6, tp_size=4) == 0  # rank-local keys are another namespace
    rank(store_section, 3, "save", seed=6, tp_size=4, store_tp_size=4)
    assert hit_tokens(store_section, seed=6, tp_size=2, store_tp_size=4) == CHUNKS * BLOCK


def test_dcp_ranks_store_under_their_own_dcp_key_and_a_hit_needs_every_one(
    store_section: dict[str, Any],
) -> None:
    """TP 2 with DCP 2: each rank holds its share of a block's tokens, keyed ``@dcp{tp_rank % 2}``."""
    first = rank(store_section, 0, "save", seed=7, dcp_size=2)["put"]
    assert all("@tp_rank:0@pcp0@dcp0@" in key for key, _ in first)
    assert hit_tokens(store_section, seed=7, dcp_size=2) == 0  # rank 1's share is missing
    second = rank(store_section, 1, "save", seed=7, dcp_size=2)["put"]
    assert all("@tp_rank:1@pcp0@dcp1@" in key for key, _ in second)
    assert hit_tokens(store_section, seed=7, dcp_size=2) == CHUNKS * BLOCK
    for tp_rank in (0, 1):
        loaded = rank(store_section, tp_rank, "load", seed=7, dcp_size=2)
        assert loaded == {"failed_blocks": [], "identical": True}


def test_tp4_ranks_save_head_shards_layer_by_layer_that_tp2_ranks_load_layer_by_layer(
    store_section: dict[str, Any],
) -> None:
    """store_tp_size 4: each TP 4 rank writes its shard a layer at a time; each TP 2 rank reads its two shards so."""
    for tp_rank in range(4):
        saved = rank(store_section, tp_rank, "save", seed=8, tp_size=4, store_tp_size=4, layerwise=True)
        assert (len(saved["put"]), saved["layered"]) == (CHUNKS, 1)
    assert hit_tokens(store_section, seed=8, tp_size=2, store_tp_size=4) == CHUNKS * BLOCK
    for tp_rank in (0, 1):
        loaded = rank(store_section, tp_rank, "load", seed=8, tp_size=2, store_tp_size=4, layerwise=True)
        assert loaded == {"failed_blocks": [], "identical": True, "layered": 1}


def test_dcp_ranks_save_and_load_their_shares_layer_by_layer(store_section: dict[str, Any]) -> None:
    for tp_rank in (0, 1):
        saved = rank(store_section, tp_rank, "save", seed=9, dcp_size=2, layerwise=True)
        assert (len(saved["put"]), saved["layered"]) == (CHUNKS, 1)
    assert hit_tokens(store_section, seed=9, dcp_size=2) == CHUNKS * BLOCK
    for tp_rank in (0, 1):
        loaded = rank(store_section, tp_rank, "load", seed=9, dcp_size=2, layerwise=True)
        assert loaded == {"failed_blocks": [], "identical": True, "layered": 1}


def kv_cache_config(spec: Any, *more: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate((spec, *more))]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups, hash_block_size=16)


def test_replicas_follow_vllms_connector_mla_every_rank_gqa_ranks_per_head_mamba_none() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    gqa = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align")
    assert tp_replicas(kv_cache_config(mla), tp_size=4, kv_heads=1, dcp_size=1) == 4
    assert tp_replicas(kv_cache_config(gqa), tp_size=4, kv_heads=2, dcp_size=1) == 2
    assert tp_replicas(kv_cache_config(gqa), tp_size=2, kv_heads=8, dcp_size=1) == 1
    assert tp_replicas(kv_cache_config(mla), tp_size=4, kv_heads=1, dcp_size=2) == 1
    assert tp_replicas(kv_cache_config(mamba), tp_size=4, kv_heads=2, dcp_size=1) == 1
    with pytest.raises(ConfigError, match="replicate over TP ranks differently"):
        tp_replicas(kv_cache_config(gqa, mamba), tp_size=4, kv_heads=2, dcp_size=1)
