"""Which KV-cache groups are stored, and their store numbering.

The engine may hold groups whose prefix cannot be reused (a ring or scratch
buffer): storing them would waste space and, worse, shift the ``group:{g}``
numbering. So the store sees only the *storable projection*: the prefix-cacheable
groups, numbered 0..k-1 in engine order. vLLM 0.32's own connector numbers
``@group:N`` the same way (its coordinator is built from
``kv_cache_config.prefix_cacheable_groups`` and its worker enumerates that list),
not by the engine's group index, which keeps the two connectors' keys equal. Everything here runs once, when the
stages are built, so a cache that cannot be saved is refused before the first
request, with a message that says which group or shard is at fault.
"""

from __future__ import annotations

from collections.abc import Sequence

from .keys import key_model_name
from .model import GroupKind, GroupSpec, KeyNamespace, KVCache, Shard, StoreGroup

#: The only mamba cache mode whose state is reusable at block boundaries.
MAMBA_ALIGN_MODE = "align"


class ProjectionError(ValueError):
    """The engine's cache cannot be saved as configured; the message says why."""


def savable_mode(kind: GroupKind, mamba_mode: str | None) -> bool:
    """Whether a group of ``kind`` can be saved in ``mamba_mode`` (a mamba group: ``align`` only)."""
    return kind is not GroupKind.MAMBA or mamba_mode == MAMBA_ALIGN_MODE


def project_groups(groups: Sequence[GroupSpec]) -> tuple[StoreGroup, ...]:
    """The storable groups of the engine's ``groups``, numbered 0..k-1 in engine order.

    A mamba group outside ``align`` mode is refused even when it is not marked
    prefix-cacheable: a hybrid model's prefix is reusable only with its mamba state,
    so without it the attention blocks saved alongside would never be loadable.
    """
    storable: list[StoreGroup] = []
    for engine_group, spec in enumerate(groups):
        if not savable_mode(spec.kind, spec.mamba_mode):
            raise ProjectionError(
                f"engine group {engine_group} is a mamba group in mode {spec.mamba_mode!r}; "
                f"its state can only be saved in mode {MAMBA_ALIGN_MODE!r}"
            )
        if spec.prefix_cacheable:
            storable.append(StoreGroup(store_group=len(storable), engine_group=engine_group, spec=spec))
    if not storable:
        kinds = ", ".join(f"{i}: {spec.kind.value}" for i, spec in enumerate(groups)) or "no groups"
        raise ProjectionError(f"no storable KV-cache group: none is prefix-cacheable ({kinds})")
    return tuple(storable)


def storable_groups(kv: KVCache) -> tuple[StoreGroup, ...]:
    """Project ``kv``'s groups and check that the cache can be saved as one engine's.

    Every shard needs a layout for every storable group, a key namespace of its own
    (else shards overwrite each other's objects) and the same model and cache
    prefix (a group id spans all ranks, so they must agree on what it contains).
    """
    if kv.hash_block_size <= 0:
        raise ProjectionError(f"hash_block_size must be > 0, got {kv.hash_block_size}")
    groups = project_groups(kv.groups)
    for group in groups:
        block_size = group.spec.block_size
        if block_size <= 0 or block_size % kv.hash_block_size:
            raise ProjectionError(
                f"engine group {group.engine_group}: block_size {block_size} is not a positive "
                f"multiple of hash_block_size {kv.hash_block_size}"
            )
    if not kv.shards:
        raise ProjectionError("the KV cache has no shard: there is nothing to save from")
    _check_shards_share_model(kv.shards)
    seen: dict[KeyNamespace, int] = {}
    for index, shard in enumerate(kv.shards):
        if shard.namespace in seen:
            raise ProjectionError(
                f"shards {seen[shard.namespace]} and {index} have the same key namespace "
                f"{shard.namespace}: their objects would overwrite each other's keys"
            )
        seen[shard.namespace] = index
        missing = [g.engine_group for g in groups if g.engine_group not in shard.layouts]
        if missing:
            raise ProjectionError(
                f"shard {index} ({shard.namespace}) has no block layout "
                f"for storable engine group(s) {missing}"
            )
    return groups


def _check_shards_share_model(shards: Sequence[Shard]) -> None:
    first = shards[0].namespace
    for index, shard in enumerate(shards):
        namespace = shard.namespace
        if (key_model_name(namespace.model), namespace.cache_prefix) != (
            key_model_name(first.model),
            first.cache_prefix,
        ):
            raise ProjectionError(
                f"shard {index} has model {namespace.model!r} and cache prefix {namespace.cache_prefix!r}, "
                f"shard 0 has {first.model!r} and {first.cache_prefix!r}: all shards must share them"
            )
