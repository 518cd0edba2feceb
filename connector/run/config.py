"""The YAML of ``kvpipe run``: a synthetic model, a workload, a store, save settings.

Every section has defaults that work, so ``{}`` is a valid (small) run. Unknown
keys are errors, and every error names its dotted path and the value it got.
``--set model.layers=8`` overrides one value before validation, so overrides are
checked exactly like the file.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvpipe.connector.store.configs import MemoryStoreConfig, StoreConfig
from kvpipe.pipeline import WhenFull
from kvpipe.pipeline.config import ConfigLoader
from kvpipe.stages import MAX_BUFFERS_PER_CALL, GroupKind, GroupSpec, Integrity, StrictFlag, project_groups
from kvpipe.stages.storable import MAMBA_ALIGN_MODE, savable_mode

#: A positive whole number as written: ``true`` or ``"8"`` is an error, not 1 or 8.
Count = Annotated[int, Field(gt=0, strict=True)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GroupConfig(_Section):
    """One KV-cache group. ``layers`` defaults to the model's; ring buffers are not prefix-cacheable."""

    kind: GroupKind = GroupKind.FULL_ATTENTION
    layers: Count | None = None
    prefix_cacheable: bool | None = None
    mamba_mode: str | None = Field(None, validate_default=True)

    @field_validator("mamba_mode")
    @classmethod
    def _mamba_state_is_saved_in_align_mode_only(cls, mode: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("kind")
        if kind is not None and not savable_mode(kind, mode):  # the projection's rule, at this field
            raise ValueError(f"a mamba group's state can only be saved in mode {MAMBA_ALIGN_MODE!r}")
        return mode

    @property
    def is_prefix_cacheable(self) -> bool:
        if self.prefix_cacheable is not None:
            return self.prefix_cacheable
        return self.kind is not GroupKind.RING_BUFFER


class ModelConfig(_Section):
    name: str = Field("synthetic-llama", min_length=1)
    layers: Count = 4
    kv_heads: Count = 4
    head_size: Count = 64
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    block_size: Count = 16
    hash_block_size: Count | None = None
    num_blocks: int = Field(2048, gt=1, strict=True)
    groups: list[GroupConfig] = Field(default_factory=lambda: [GroupConfig()], min_length=1)

    @field_validator("groups")
    @classmethod
    def _some_group_is_storable(cls, groups: list[GroupConfig]) -> list[GroupConfig]:
        """The save path's own verdict (its projection), given before any store is opened."""
        block_size = 1  # plays no part in which groups are stored
        project_groups([GroupSpec(g.kind, block_size, g.is_prefix_cacheable, g.mamba_mode) for g in groups])
        return groups  # (a ProjectionError is a ValueError: reported at model.groups)

    @field_validator("hash_block_size")
    @classmethod
    def _hash_block_divides_block(cls, hash_block_size: int | None, info: ValidationInfo) -> int | None:
        block_size = info.data.get("block_size")
        if hash_block_size is not None and block_size is not None and block_size % hash_block_size:
            raise ValueError(f"must divide block_size ({block_size})")
        return hash_block_size

    @property
    def effective_hash_block_size(self) -> int:
        return self.hash_block_size or self.block_size


class ParallelConfig(_Section):
    tp_size: Count = 1


class WorkloadConfig(_Section):
    seed: int = Field(0, strict=True)
    requests: Count = 300
    system_prompts: Count = 4
    system_prompt_tokens: tuple[int, int] = (64, 512)
    user_tokens: tuple[int, int] = (16, 128)
    output_tokens: tuple[int, int] = (16, 64)
    max_turns: Count = 4
    vocab_size: int = Field(32000, gt=1, strict=True)
    concurrency: Count = 32
    prefill_tokens_per_step: Count = 256
    decode_tokens_per_step: Count = 8

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
    max_buffers_per_call: Count = MAX_BUFFERS_PER_CALL
    queue_capacity: Count = 1024
    when_full: WhenFull = WhenFull.WAIT
    #: seal every object put (its checksum and fingerprint beside it); off: sizes only
    integrity: Integrity = Integrity.VERIFY


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
        target[keys[-1]] = yaml.load(raw, ConfigLoader)
    except yaml.YAMLError as exc:
        # only marked errors (scanner, parser) carry .problem; a ReaderError (a control character) does not
        problem = exc.problem if isinstance(exc, yaml.MarkedYAMLError) else exc
        raise ValueError(f"--set {assignment!r}: the value is not valid YAML ({problem})") from None
