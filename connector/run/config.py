"""The YAML of ``kvpipe run``: a synthetic model, a workload, a store, save settings.

Every section has defaults that work, so ``{}`` is a valid (small) run. Unknown
keys are errors, and every error names its dotted path and the value it got.
``--set model.layers=8`` overrides one value before validation, so overrides are
checked exactly like the file.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpipe.connector.stores import MemoryStoreConfig, StoreConfig
from kvpipe.pipeline import WhenFull
from kvpipe.stages import GroupKind, StrictFlag


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GroupConfig(_Section):
    """One KV-cache group. ``layers`` defaults to the model's; ring buffers are not prefix-cacheable."""

    kind: GroupKind = GroupKind.FULL_ATTENTION
    layers: int | None = Field(None, gt=0)
    prefix_cacheable: bool | None = None
    mamba_mode: str | None = None

    @property
    def is_prefix_cacheable(self) -> bool:
        if self.prefix_cacheable is not None:
            return self.prefix_cacheable
        return self.kind is not GroupKind.RING_BUFFER


class ModelConfig(_Section):
    name: str = Field("synthetic-llama", min_length=1)
    layers: int = Field(4, gt=0)
    kv_heads: int = Field(4, gt=0)
    head_size: int = Field(64, gt=0)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    block_size: int = Field(16, gt=0)
    hash_block_size: int | None = Field(None, gt=0)
    num_blocks: int = Field(2048, gt=1)
    groups: list[GroupConfig] = Field(default_factory=lambda: [GroupConfig()], min_length=1)

    @model_validator(mode="after")
    def _hash_block_divides_block(self) -> ModelConfig:
        if self.block_size % self.effective_hash_block_size:
            raise ValueError(
                f"block_size ({self.block_size}) must be a multiple of hash_block_size ({self.hash_block_size})"
            )
        return self

    @property
    def effective_hash_block_size(self) -> int:
        return self.hash_block_size or self.block_size


class ParallelConfig(_Section):
    tp_size: int = Field(1, gt=0)


class WorkloadConfig(_Section):
    seed: int = 0
    requests: int = Field(300, gt=0)
    system_prompts: int = Field(4, gt=0)
    system_prompt_tokens: tuple[int, int] = (64, 512)
    user_tokens: tuple[int, int] = (16, 128)
    output_tokens: tuple[int, int] = (16, 64)
    max_turns: int = Field(4, gt=0)
    vocab_size: int = Field(32000, gt=1)
    concurrency: int = Field(32, gt=0)
    prefill_tokens_per_step: int = Field(256, gt=0)
    decode_tokens_per_step: int = Field(8, gt=0)

    @model_validator(mode="after")
    def _ranges_are_ordered(self) -> WorkloadConfig:
        for name in ("system_prompt_tokens", "user_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name}: must be [min, max] with 0 <= min <= max, got [{low}, {high}]")
        return self


class SaveConfig(_Section):
    enable_group_semantics: StrictFlag = False
    cache_prefix: str = ""
    max_buffers_per_call: int = Field(2048, gt=0)
    queue_capacity: int = Field(1024, gt=0)
    when_full: WhenFull = WhenFull.WAIT


class RunConfig(_Section):
    store: StoreConfig = Field(default_factory=MemoryStoreConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    save: SaveConfig = Field(default_factory=SaveConfig)
    pipeline: dict[str, Any] | None = None  # a custom save graph; default: kvpipe's

    @model_validator(mode="before")
    @classmethod
    def _memory_is_the_default_store_kind(cls, document: Any) -> Any:
        if isinstance(document, dict) and isinstance(document.get("store"), dict):
            document = {**document, "store": {"kind": "memory", **document["store"]}}
        return document

    @model_validator(mode="after")
    def _heads_split_over_ranks(self) -> RunConfig:
        if self.model.kv_heads % self.parallel.tp_size:
            raise ValueError(
                f"model.kv_heads ({self.model.kv_heads}) must be a multiple of parallel.tp_size ({self.parallel.tp_size})"
            )
        return self


def apply_override(document: dict[str, Any], assignment: str) -> None:
    """Apply ``dotted.path=value`` (the value parsed as YAML) to ``document`` in place."""
    path, sep, raw = assignment.partition("=")
    if not sep or not path.strip():
        raise ValueError(f"--set {assignment!r}: expected dotted.path=value")
    keys = path.strip().split(".")
    target = document
    for depth, key in enumerate(keys[:-1]):
        child = target.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"--set {assignment!r}: {'.'.join(keys[: depth + 1])} is not a section")
        target = child
    try:
        target[keys[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ValueError(f"--set {assignment!r}: the value is not valid YAML ({exc.problem})") from None
