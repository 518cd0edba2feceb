"""What both connector roles know of the engine's cache: its groups, the storable ones, key namespaces, the store.

The scheduler and the worker of one engine live in different processes (vLLM's
default) and each builds one :class:`EngineCache` from the same vLLM config, so
they agree on which groups are stored, how they are numbered and how keys read,
without talking to each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpipe.stages import (
    BlockLayout,
    GroupKind,
    GroupSpec,
    KeyNamespace,
    KVCache,
    Shard,
    StoreGroup,
    key_model_name,
    storable_groups,
)
from kvpipe.stages.flags import ConfigError

from ..memory import MemoryStore
from ..mooncake import MooncakeSettings
from ..store import Store
from ..stores import MemoryStoreConfig, MooncakeStoreConfig, connect, guarded
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
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


@dataclass(frozen=True)
class EngineCache:
    """One engine's cache as the store sees it: groups, storable projection, rank namespaces.

    ``store_groups`` is the storable projection (prefix-cacheable groups, numbered
    0..k-1 in engine order), which is also how vLLM 0.32's own connector numbers
    ``@group:N``: its coordinator is built from ``prefix_cacheable_groups``.
    Raises :class:`~kvpipe.stages.ProjectionError` at construction for a cache
    that cannot be saved (no storable group, mamba not in ``align`` mode).
    """

    groups: tuple[GroupSpec, ...]
    hash_block_size: int
    model: str
    cache_prefix: str
    tp_size: int
    pp_rank: int
    layer_names: tuple[tuple[str, ...], ...]  # per engine group
    num_blocks: int
    layout_name: str

    @classmethod
    def of(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings, pp_rank: int = 0
    ) -> EngineCache:
        mamba_mode = getattr(vllm_config.cache_config, "mamba_cache_mode", None)
        return cls(
            groups=groups_of(kv_cache_config, mamba_mode),
            hash_block_size=int(kv_cache_config.hash_block_size),
            model=key_model_name(vllm_config.model_config.model),
            cache_prefix=settings.cache_prefix,
            tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            pp_rank=pp_rank,
            layer_names=tuple(tuple(g.layer_names) for g in kv_cache_config.kv_cache_groups),
            num_blocks=int(kv_cache_config.num_blocks),
            layout_name=str(getattr(kv_cache_config, "kv_cache_layout", None) or "unresolved"),
        )

    store_groups: tuple[StoreGroup, ...] = field(init=False)
    #: every TP rank's namespace: a chunk is a hit only if every rank stored it
    lookup_shards: tuple[Shard, ...] = field(init=False)

    def __post_init__(self) -> None:
        # Validate the projection now (no memory needed): a bad config fails at start.
        every_group = self.kv_cache({g: BlockLayout(()) for g in range(len(self.groups))})
        object.__setattr__(self, "store_groups", storable_groups(every_group))
        stored = self.kv_cache({g.engine_group: BlockLayout(()) for g in self.store_groups})
        object.__setattr__(self, "lookup_shards", stored.shards)

    def namespace(self, tp_rank: int) -> KeyNamespace:
        return KeyNamespace(self.model, self.cache_prefix, tp_rank=tp_rank, pp_rank=self.pp_rank)

    def kv_cache(self, layouts: Mapping[int, BlockLayout], tp_ranks: Sequence[int] | None = None) -> KVCache:
        """The cache with ``layouts`` (by engine group) for ``tp_ranks`` (default: every rank)."""
        ranks = range(self.tp_size) if tp_ranks is None else tp_ranks
        shards = tuple(Shard(self.namespace(rank), dict(layouts)) for rank in ranks)
        return KVCache(self.groups, self.hash_block_size, shards)


# The memory store serves in-process engines only (scheduler and worker share it), and
# every connector of the process shares it: none of them owns it, none closes it.
_MEMORY_STORES: dict[str, MemoryStore] = {}


def open_store(settings: ConnectorSettings, *, mount_segment: bool) -> tuple[Store, bool]:
    """The connector's store, and whether the connector owns it (closes it at shutdown).

    ``store`` unset: vLLM's Mooncake JSON (``MOONCAKE_CONFIG_PATH``), so existing
    vLLM setups work as they are. ``mount_segment=False`` (the scheduler: it only
    asks what exists) lends the store no memory.
    """
    config = settings.store
    if isinstance(config, MemoryStoreConfig):
        key = config.model_dump_json()
        if key not in _MEMORY_STORES:
            _MEMORY_STORES[key] = config.build()
        return guarded(_MEMORY_STORES[key], config.breaker), False
    if config is None:
        config = MooncakeStoreConfig.model_validate(MooncakeSettings.from_vllm_env().model_dump())
    if config.master == "spawn":
        raise ConfigError(
            "kv_connector_extra_config.store.master: 'spawn' cannot serve vLLM (the scheduler and the "
            "worker must share one master); give 'host:port' of a running mooncake_master, got 'spawn'"
        )
    return connect(config, mount_segment=mount_segment), True
