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

    kind: GroupKind = Field(
        GroupKind.FULL_ATTENTION,
        description="`full_attention`, `sliding_window`, `ring_buffer` (never stored) or `mamba` (one state per block).",
    )
    layers: Count | None = Field(None, description="Layers of this group; null: the model's `layers`.")
    prefix_cacheable: bool | None = Field(
        None,
        description="The engine's verdict on reusing a prefix of this group; null: every kind but `ring_buffer` is.",
    )
    mamba_mode: str | None = Field(
        None,
        validate_default=True,
        description="A mamba group's mode: its state is stored only in `align` mode (any other is an error).",
    )

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
    name: str = Field(
        "synthetic-llama", min_length=1, description="The model part of every key and group id."
    )
    layers: Count = Field(4, description="Layers of each group that does not give its own.")
    kv_heads: Count = Field(
        4, description="KV heads, split over `parallel.tp_size` ranks (a multiple of it)."
    )
    head_size: Count = Field(64, description="Elements per head (K and V each).")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="The cache's dtype.")
    block_size: Count = Field(16, description="Tokens per block, which is a stored chunk.")
    hash_block_size: Count | None = Field(
        None,
        description="Tokens per block hash (divides `block_size`; smaller makes partial tails); "
        "null: `block_size`.",
    )
    num_blocks: int = Field(
        2048, gt=1, strict=True, description="Blocks per group and rank; requests wait for free blocks."
    )
    groups: list[GroupConfig] = Field(
        default_factory=lambda: [GroupConfig()],
        min_length=1,
        description="The KV-cache groups in engine order (`model.groups[]` below); at least one must be stored.",
    )

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
    tp_size: Count = Field(1, description="TP ranks: each its own tensors and key namespace.")


class WorkloadConfig(_Section):
    seed: int = Field(0, strict=True, description="Everything the workload draws follows from it.")
    requests: Count = Field(300, description="Requests (conversation turns) to run.")
    system_prompts: Count = Field(4, description="System prompts that the conversations share.")
    system_prompt_tokens: tuple[int, int] = Field(
        (64, 512), description="A system prompt's length, [min, max]."
    )
    user_tokens: tuple[int, int] = Field((16, 128), description="A turn's new user tokens, [min, max].")
    output_tokens: tuple[int, int] = Field((16, 64), description="A turn's output tokens, [min, max].")
    max_turns: Count = Field(
        4, description="Turns of a conversation at most; a turn's prompt is the context so far."
    )
    vocab_size: int = Field(32000, gt=1, strict=True, description="Token ids are drawn below it.")
    concurrency: Count = Field(32, description="Requests running at once.")
    prefill_tokens_per_step: Count = Field(
        256, description="Prompt tokens a request computes per engine step."
    )
    decode_tokens_per_step: Count = Field(8, description="Output tokens a request computes per engine step.")

    @model_validator(mode="after")
    def _ranges_are_ordered(self) -> WorkloadConfig:
        for name in ("system_prompt_tokens", "user_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name}: must be [min, max] with 0 <= min <= max, got [{low}, {high}]")
        return self


class SaveConfig(_Section):
    enable_group_semantics: StrictFlag = Field(
        False,
        description="Put every object of a chunk under one Mooncake group id, so the store evicts the chunk "
        "whole. true or false only.",
    )
    cache_prefix: str = Field("", description="A namespace in every key and group id.")
    max_buffers_per_call: Count = Field(
        MAX_BUFFERS_PER_CALL,
        description="Buffers one put call sends at most (more to one peer make Mooncake fail with -800).",
    )
    queue_capacity: Count = Field(1024, description="Save requests the sync bridge's entry holds.")
    when_full: WhenFull = Field(
        WhenFull.WAIT,
        description="At a full entry: `wait`, or `drop` (the save is dropped and counted; the caller never blocks).",
    )
    integrity: Integrity = Field(
        Integrity.VERIFY,
        description="Seals (docs/integrity.md): `verify` seals every object put (its checksum and fingerprint "
        "beside it) and loads check them, `required` also makes a chunk without seals a miss, `off` checks sizes only.",
    )


class RunConfig(_Section):
    store: StoreConfig = Field(
        default_factory=MemoryStoreConfig, description="The store: `kind` memory (the default) or mooncake."
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="The synthetic model whose KV cache is saved."
    )
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="The engine's ranks.")
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig, description="The seeded chat workload.")
    save: SaveConfig = Field(default_factory=SaveConfig, description="The save path's settings.")
    pipeline: dict[str, Any] | None = Field(
        None,
        description="A custom save graph, `{stages: [...]}` as in configs/save-pipeline.yaml: its stages' params "
        "then rule, not `save.enable_group_semantics`, `save.max_buffers_per_call` or `save.integrity`; null: "
        "kvpipe's default graph.",
    )

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
