"""MLA and hybrid models in the real engine: hits, identical outputs, one cache with vLLM's connector.

- MLA: a tiny DeepSeek-V2 (one latent per token; vLLM's own prefix cache is off for it
  on CPU, so every pass-2 hit is the connector's), on both of the CPU build's MLA
  backends: ``CPU_MLA`` (16-token blocks, its kernel's only size; it runs everywhere and
  is asked for by name) and ``AMX_MLA`` (128-token blocks; where the CPU has AMX, else
  skipped with that reason). Counts come from the block size the engine chose.
- Hybrid: a tiny Qwen3-Next, three mamba groups (GDN, ``align``) and one
  full-attention group overlaying one cache; a hit needs every attention chunk and
  each mamba group's state where it ends. The block size is the engine's choice (the
  attention page must hold a mamba state, rounded to the CPU kernel's block multiple:
  256 or 384 tokens on the machines tried), so counts follow it.
- Sliding window: a tiny Gemma 3, sliding-window layers (a 256-token window) between
  full-attention ones, two groups. Every whole block of both is stored; a hit loads
  every full-attention block and only the sliding-window blocks attention past the hit
  reads (the engine lists its null block for the others).
- KV sharing: a tiny Gemma 4, sliding-window and full-attention layers alternating, the
  last two reading the KV of earlier layers (they have no cache of their own): the same
  two groups and objects as the Gemma 3, the shared layers adding nothing to them.
- Chunked local attention: a tiny Llama 4, three chunked-attention layers (256-token chunks)
  and one full-attention layer, four groups: a hit loads the full-attention blocks and, of
  the chunked groups, only the blocks of the chunk the hit ends in.
- Hybrid with partial hits (``prefix_match_unit=128``): the engine hashes every 128
  tokens and a hit may end inside a block: on the prompt's partial tail (the
  attention block holding it, keyed where it ends, and the mamba states there).
  The only engine configuration on the CPU build with tails: a single KV-cache group
  refuses a ``prefix_match_unit`` other than its block size.

Each kind runs a kvpipe engine in this process and vLLM's own ``MooncakeStoreConnector``
in a process of its own, on the session's master: each stores what the other loads.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpipe.connector.engines import launch
from kvpipe.stages.chunks import is_recurrent

from . import engine
from .kinds import ENGINE, KINDS, MAX_TOKENS, Engine, Kind, prompts, vllm_connector


@pytest.fixture(scope="module", params=KINDS, ids=lambda kind: kind.name)
def kvpipe(request: pytest.FixtureRequest, store_section: dict[str, Any]) -> Iterator[Engine]:
    kind: Kind = request.param
    if (missing := kind.needs()) is not None:
        pytest.skip(missing)
    transfer = launch.kvpipe_transfer({"store": store_section}, load_failure_policy="recompute")
    llm = launch.make_llm(kind.model, transfer, **ENGINE, **kind.engine_args)
    yield Engine(kind, llm)
    launch.close_llm(llm)


def test_the_engine_has_the_kv_cache_groups_of_its_kind(kvpipe: Engine) -> None:
    assert len(engine.scheduler(kvpipe.llm).cache.groups) == kvpipe.kind.groups
    assert len(engine.worker(kvpipe.llm).cache.store_groups) == kvpipe.kind.groups  # all of them are stored


def test_a_reset_engine_loads_every_stored_chunk_with_identical_outputs(kvpipe: Engine) -> None:
    batch = prompts(31)
    first, records = engine.stored_by(kvpipe.llm, batch)
    assert first["cached"] == [0, 0]
    assert len({r.key for r in records}) == 2 * kvpipe.objects_per_prompt
    assert kvpipe.llm.reset_prefix_cache()
    loaded = engine.worker(kvpipe.llm).stats["chunks_loaded"]
    second = kvpipe.generate(batch)
    assert second["cached"] == [kvpipe.full_hit] * 2
    assert second["connector_hits"] == 2 * kvpipe.full_hit
    assert engine.worker(kvpipe.llm).stats["chunks_loaded"] - loaded == 2 * kvpipe.loads_per_prompt
    assert second["tokens"] == first["tokens"]


def test_vllms_connector_and_kvpipe_load_what_the_other_stored(kvpipe: Engine, mooncake_json: Path) -> None:
    ours, theirs = prompts(32), prompts(33)
    stored, _ = engine.stored_by(kvpipe.llm, ours)
    gen = [{"generate": batch, "max_tokens": MAX_TOKENS} for batch in (ours, theirs)]
    hit, own, _ = vllm_connector(kvpipe.kind, mooncake_json, [*gen, {"sleep": 1}])
    print(
        f"{kvpipe.kind.name}: kvpipe -> vLLM cached {hit['cached']}, tokens equal {hit['tokens'] == stored['tokens']}"
    )
    assert hit["cached"] == [kvpipe.full_hit] * 2
    assert hit["tokens"] == stored["tokens"]
    assert own["cached"] == [0, 0]
    back = kvpipe.generate(theirs)
    print(
        f"{kvpipe.kind.name}: vLLM -> kvpipe cached {back['cached']}, tokens equal {back['tokens'] == own['tokens']}"
    )
    assert back["cached"] == [kvpipe.full_hit] * 2
    assert back["tokens"] == own["tokens"]


def test_a_burst_over_shared_prefixes_stores_every_whole_block(kvpipe: Engine) -> None:
    """Eight ~750-token prompts over four shared prefixes in one pass: every whole block is
    stored once, as vLLM's connector stores them (at 16-token blocks, more blocks than the
    staging area once held)."""
    groups = engine.worker(kvpipe.llm).cache.store_groups
    if any(is_recurrent(group) for group in groups):
        pytest.skip("a hybrid model stores per mamba group where its steps end, not per whole block")
    rng = random.Random(34)
    shared = [[rng.randrange(1024) for _ in range(500)] for _ in range(4)]
    batch = [
        p + [rng.randrange(1024) for _ in range(rng.randrange(200, 300))] for p in shared for _ in range(2)
    ]
    size = kvpipe.block_size
    whole_prefixes = {tuple(p[:end]) for p in batch for end in range(size, len(p) + 1, size)}
    _, records = engine.stored_by(kvpipe.llm, batch)
    assert engine.worker(kvpipe.llm).stats["saves_dropped_no_staging"] == 0
    assert len({r.key for r in records}) == len(whole_prefixes) * len(groups)  # every group's block
