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

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpipe.connector.engines import launch
from kvpipe.stages.chunks import is_recurrent

from . import engine

PROMPT_TOKENS = 1400
MAX_TOKENS = 8


@dataclass(frozen=True)
class Kind:
    name: str
    config: dict[str, Any]
    engine_args: dict[str, Any]
    groups: int  # the engine's KV-cache groups
    # given the stored groups' block size: what one 1,400-token prompt stores (as vLLM's
    # connector does), and what its hit loads (every attention chunk, one state per mamba group)
    objects_per_prompt: Callable[[int], int]
    loads_per_prompt: Callable[[int], int]
    needs: Callable[[], str | None] = lambda: None  # why this machine cannot run it, if it cannot

    @property
    def model(self) -> Path:
        return launch.model_dir(f"tiny-{self.config['model_type'].replace('_', '-')}", self.config)


def _amx() -> str | None:
    import torch

    return (
        None
        if torch.cpu._is_amx_tile_supported()
        else "AMX_MLA needs a CPU with AMX tiles; this one has none"
    )


def _whole_blocks(block_size: int) -> int:
    return PROMPT_TOKENS // block_size


def _hit_blocks(block_size: int) -> int:
    return (PROMPT_TOKENS - 1) // block_size


def mla(backend: str, needs: Callable[[], str | None] = lambda: None) -> Kind:
    """The tiny DeepSeek-V2 on MLA backend ``backend``: every whole block of latent is stored."""
    name = f"deepseek-v2-{backend.lower().replace('_', '-')}"
    engine_args = {"attention_backend": backend}
    return Kind(name, launch.TINY_DEEPSEEK_V2, engine_args, 1, _whole_blocks, _hit_blocks, needs)


MAMBA_GROUPS = 3  # the tiny Qwen3-Next's linear-attention layers, one group each
HASH_UNIT = 128  # the partial-hit kind's ``prefix_match_unit``
TAIL_END = (PROMPT_TOKENS - 1) // HASH_UNIT * HASH_UNIT  # where its longest hit ends


def _hybrid_objects(block_size: int) -> int:
    """Every whole attention block, and per mamba group its state where the first step ends
    (``align`` mode ends a prefill step on a block boundary: after the last whole block)."""
    return _whole_blocks(block_size) + MAMBA_GROUPS


def _hybrid_loads(block_size: int) -> int:
    return _hit_blocks(block_size) + MAMBA_GROUPS


def _partial_objects(block_size: int) -> int:
    """And where the longest hit ends inside a block: that block, keyed at the tail's end,
    and each mamba group's state there too."""
    inside = TAIL_END % block_size != 0
    return _whole_blocks(block_size) + inside + MAMBA_GROUPS * (1 + inside)


def _partial_loads(block_size: int) -> int:
    """Every attention block up to the tail's end (the last one partly), one state per mamba group."""
    return math.ceil(TAIL_END / block_size) + MAMBA_GROUPS


WINDOW = launch.TINY_GEMMA3["sliding_window"]  # and the Gemma 4's


def _windowed_objects(block_size: int) -> int:
    return 2 * _whole_blocks(block_size)


def _windowed_loads(block_size: int) -> int:
    """Every full-attention block of the hit, and the sliding-window blocks from the first its window reads."""
    hit = _hit_blocks(block_size) * block_size
    return _hit_blocks(block_size) + _hit_blocks(block_size) - (hit - WINDOW + 1) // block_size


CHUNK = launch.TINY_LLAMA4["attention_chunk_size"]
CHUNKED_GROUPS = 3


def _chunked_objects(block_size: int) -> int:
    return (1 + CHUNKED_GROUPS) * _whole_blocks(block_size)


def _chunked_loads(block_size: int) -> int:
    """Every full-attention block of the hit; of each chunked group, the blocks from its chunk's start."""
    hit = _hit_blocks(block_size) * block_size
    return _hit_blocks(block_size) + CHUNKED_GROUPS * (_hit_blocks(block_size) - hit // CHUNK * CHUNK // block_size)


KINDS = [
    # every whole block of latent: 87 at CPU_MLA's 16 tokens, 10 at AMX_MLA's 128
    mla("CPU_MLA"),
    mla("AMX_MLA", needs=_amx),
    Kind(
        "qwen3-next",
        launch.TINY_QWEN3_NEXT,
        launch.HYBRID_ENGINE_ARGS,
        groups=MAMBA_GROUPS + 1,
        objects_per_prompt=_hybrid_objects,
        loads_per_prompt=_hybrid_loads,
    ),
    Kind(
        "gemma3",
        launch.TINY_GEMMA3,
        {},
        groups=2,
        objects_per_prompt=_windowed_objects,
        loads_per_prompt=_windowed_loads,
    ),
    Kind(
        "gemma4-kv-sharing",
        launch.TINY_GEMMA4,
        {},
        groups=2,
        objects_per_prompt=_windowed_objects,
        loads_per_prompt=_windowed_loads,
    ),
    Kind(
        "llama4",
        launch.TINY_LLAMA4,
        {},
        groups=1 + CHUNKED_GROUPS,
        objects_per_prompt=_chunked_objects,
        loads_per_prompt=_chunked_loads,
    ),
    Kind(
        "qwen3-next-partial",
        launch.TINY_QWEN3_NEXT,
        {**launch.HYBRID_ENGINE_ARGS, "prefix_match_unit": HASH_UNIT},
        groups=MAMBA_GROUPS + 1,
        objects_per_prompt=_partial_objects,
        loads_per_prompt=_partial_loads,
    ),
]
ENGINE = {"max_model_len": 2048, "kv_cache_memory_bytes": 256 << 20}


@dataclass
class Engine:
    kind: Kind
    llm: Any

    @property
    def block_size(self) -> int:
        """The stored groups' block size, as the engine chose it (MLA's depends on the backend)."""
        return min(g.spec.block_size for g in engine.worker(self.llm).cache.store_groups)

    @property
    def objects_per_prompt(self) -> int:
        return self.kind.objects_per_prompt(self.block_size)

    @property
    def loads_per_prompt(self) -> int:
        return self.kind.loads_per_prompt(self.block_size)

    def generate(self, batch: list[list[int]]) -> dict[str, Any]:
        return launch.generate(self.llm, batch, MAX_TOKENS).as_dict()

    @property
    def full_hit(self) -> int:
        """The longest hit of a prompt: whole grains (partial hits' alignment, or the stored groups' lcm)."""
        cache = engine.scheduler(self.llm).cache
        grain = cache.hit_alignment or math.lcm(*(g.spec.block_size for g in cache.store_groups))
        return (PROMPT_TOKENS - 1) // grain * grain


@pytest.fixture(scope="module", params=KINDS, ids=lambda kind: kind.name)
def kvpipe(request: pytest.FixtureRequest, store_section: dict[str, Any]) -> Iterator[Engine]:
    kind: Kind = request.param
    if (missing := kind.needs()) is not None:
        pytest.skip(missing)
    transfer = launch.kvpipe_transfer({"store": store_section}, load_failure_policy="recompute")
    llm = launch.make_llm(kind.model, transfer, **ENGINE, **kind.engine_args)
    yield Engine(kind, llm)
    launch.close_llm(llm)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(PROMPT_TOKENS)] for _ in range(2)]


def vllm_connector(kind: Kind, mooncake_json: Path, commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
    spec = {
        "model": str(kind.model),
        "transfer": launch.mooncake_transfer(),
        **ENGINE,
        "engine_args": kind.engine_args,
    }
    from kvpipe.connector.bench.vllm_engine import EngineProcess

    with EngineProcess(spec, launch.vllm_mooncake_env(mooncake_json)) as process:
        return [process.call(command) for command in commands]


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
