"""The engine's KV-cache groups as kvpipe sees them: vLLM specs -> :class:`GroupSpec`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpipe.stages import GroupKind, GroupSpec

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def _group_spec(spec: Any, mamba_mode: str | None) -> GroupSpec:
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    block_size = int(spec.block_size)
    cacheable = bool(getattr(spec, "prefix_cacheable", True))
    if isinstance(spec, MambaSpec):
        return GroupSpec(
            GroupKind.MAMBA, block_size, cacheable, getattr(spec, "mamba_cache_mode", mamba_mode)
        )
    if isinstance(spec, SlidingWindowSpec):
        return GroupSpec(GroupKind.SLIDING_WINDOW, block_size, cacheable)
    if type(spec).__name__ in ("CircularBufferSpec",):
        return GroupSpec(GroupKind.RING_BUFFER, block_size, False)
    return GroupSpec(GroupKind.FULL_ATTENTION, block_size, cacheable)


def groups_of(kv_cache_config: KVCacheConfig, mamba_mode: str | None) -> tuple[GroupSpec, ...]:
    """One :class:`GroupSpec` per engine KV-cache group, in the engine's order."""
    return tuple(_group_spec(group.kv_cache_spec, mamba_mode) for group in kv_cache_config.kv_cache_groups)
