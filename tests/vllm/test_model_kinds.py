"""MLA and hybrid models in the real engine: hits, identical outputs, one cache with vLLM's connector.

- MLA: a tiny DeepSeek-V2 (``CPU_MLA``, one latent per token; vLLM's own prefix cache
  is off for it on CPU, so every pass-2 hit is the connector's).
- Hybrid: a tiny Qwen3-Next, three mamba groups (GDN, ``align``) and one
  full-attention group overlaying one cache (384-token blocks); a hit needs every
  attention chunk and each mamba group's state where it ends.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpipe.connector.bench import launch

from . import engine
from .test_connector import stored_by

PROMPT_TOKENS = 1400
MAX_TOKENS = 8


@dataclass(frozen=True)
class Kind:
    name: str
    config: dict[str, Any]
    engine_args: dict[str, Any]
    groups: int  # the engine's KV-cache groups
    objects_per_prompt: int  # what one 1,400-token prompt stores (as vLLM's connector does)
    loads_per_prompt: int  # what its hit loads: every attention chunk, one state per mamba group

    @property
    def model(self) -> Path:
        return launch.model_dir(f"tiny-{self.config['model_type'].replace('_', '-')}", self.config)


KINDS = [
    # ten 128-token chunks of latent
    Kind("deepseek-v2", launch.TINY_DEEPSEEK_V2, {}, groups=1, objects_per_prompt=10, loads_per_prompt=10),
    # three attention chunks; per mamba group the state at 1,152, where vLLM ends the first step
    Kind(
        "qwen3-next",
        launch.TINY_QWEN3_NEXT,
        launch.HYBRID_ENGINE_ARGS,
        groups=4,
        objects_per_prompt=3 + 3,
        loads_per_prompt=3 + 3,
    ),
    # and the partial tail at 1,280: the attention block holding it, each mamba group's state there
    Kind(
        "qwen3-next-partial",
        launch.TINY_QWEN3_NEXT,
        {**launch.HYBRID_ENGINE_ARGS, "prefix_match_unit": 128},
        groups=4,
        objects_per_prompt=(3 + 1) + 3 * 2,
        loads_per_prompt=(3 + 1) + 3,
    ),
]
ENGINE = {"max_model_len": 2048, "kv_cache_memory_bytes": 256 << 20}


@dataclass
class Engine:
    kind: Kind
    llm: Any

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
    transfer = {**launch.kvpipe_transfer({"store": store_section}), "kv_load_failure_policy": "recompute"}
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
    first, records = stored_by(kvpipe.llm, batch)
    assert first["cached"] == [0, 0]
    assert len({r.key for r in records}) == 2 * kvpipe.kind.objects_per_prompt
    assert kvpipe.llm.reset_prefix_cache()
    loaded = engine.worker(kvpipe.llm).stats["chunks_loaded"]
    second = kvpipe.generate(batch)
    assert second["cached"] == [kvpipe.full_hit] * 2
    assert second["connector_hits"] == 2 * kvpipe.full_hit
    assert engine.worker(kvpipe.llm).stats["chunks_loaded"] - loaded == 2 * kvpipe.kind.loads_per_prompt
    assert second["tokens"] == first["tokens"]


def test_vllms_connector_and_kvpipe_load_what_the_other_stored(kvpipe: Engine, mooncake_json: Path) -> None:
    ours, theirs = prompts(32), prompts(33)
    stored, _ = stored_by(kvpipe.llm, ours)
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
