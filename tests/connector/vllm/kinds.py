"""The model kinds beside the tiny Llama, as the real-engine tests run them: configs, counts, engines.

A :class:`Kind` is a tiny dummy-weight model (built from its ``config.json``), the
engine arguments it needs, and what one prompt of :data:`PROMPT_TOKENS` stores and
loads given the block size the engine chose. :func:`vllm_connector` runs vLLM's own
``MooncakeStoreConnector`` on a kind in a process of its own.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpipe.connector.bench.vllm_engine import EngineProcess
from kvpipe.connector.engines import launch

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


#: every whole block of latent: 87 at CPU_MLA's 16 tokens
CPU_MLA = mla("CPU_MLA")
HYBRID = Kind(
    "qwen3-next",
    launch.TINY_QWEN3_NEXT,
    launch.HYBRID_ENGINE_ARGS,
    groups=MAMBA_GROUPS + 1,
    objects_per_prompt=_hybrid_objects,
    loads_per_prompt=_hybrid_loads,
)
#: grouped-query attention, one group: every whole block, like the tiny Llama's
GQA = Kind("qwen3-gqa", launch.TINY_QWEN3, {}, groups=1, objects_per_prompt=_whole_blocks, loads_per_prompt=_hit_blocks)

KINDS = [
    CPU_MLA,
    mla("AMX_MLA", needs=_amx),  # 10 blocks at its 128 tokens
    HYBRID,
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
    with EngineProcess(spec, launch.vllm_mooncake_env(mooncake_json)) as process:
        return [process.call(command) for command in commands]
