"""What both connector roles know of the engine's cache: its groups, the storable ones, key namespaces, the store.

The scheduler and the worker of one engine live in different processes (vLLM's
default) and each builds one :class:`EngineCache` from the same vLLM config, so
they agree on which groups are stored, how they are numbered and how keys read,
without talking to each other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpipe.connector.store.configs import (
    AnyStoreConfig,
    MemoryStoreConfig,
    MooncakeStoreConfig,
    connect,
    guarded,
)
from kvpipe.connector.store.memory import MemoryStore
from kvpipe.connector.store.metered import OperationLog
from kvpipe.connector.store.mooncake import MooncakeSettings
from kvpipe.connector.store.protocol import Store
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
from kvpipe.stages.errors import ConfigError
from kvpipe.stages.integrity import engine_facts

from .settings import ConnectorSettings
from .store_format import EngineShape, StoreFormat, store_format

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def _group_spec(spec: Any, mamba_mode: str | None, dcp_size: int = 1) -> GroupSpec:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

    # Under DCP a block-table entry spans the tokens of every DCP rank's block (each rank
    # holds its share): that span is the group's block as the scheduler and hashes see it.
    block_size = int(spec.block_size) * (dcp_size if getattr(spec, "dcp_sharded", False) else 1)
    cacheable = bool(getattr(spec, "prefix_cacheable", True))
    if isinstance(spec, MambaSpec):
        return GroupSpec(
            GroupKind.MAMBA, block_size, cacheable, getattr(spec, "mamba_cache_mode", mamba_mode)
        )
    if isinstance(spec, SlidingWindowSpec):
        # the blocks the engine keeps reach back the window and its retained tail (speculative decoding)
        window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))
        return GroupSpec(GroupKind.SLIDING_WINDOW, block_size, cacheable, sliding_window=window)
    if type(spec).__name__ in ("CircularBufferSpec",):
        return GroupSpec(GroupKind.RING_BUFFER, block_size, False)
    # Chunked local attention (Llama 4) as its own group: the engine frees the blocks before a
    # position's chunk. A FullAttentionSpec may carry a window or a chunk size too (the engine
    # then keeps every block and computes the window in the model): full attention here.
    chunk = int(spec.attention_chunk_size) if isinstance(spec, ChunkedLocalAttentionSpec) else 0
    return GroupSpec(GroupKind.FULL_ATTENTION, block_size, cacheable, attention_chunk=chunk)


def partial_hit_alignment(groups: tuple[GroupSpec, ...], alignment: int | None) -> int | None:
    """vLLM's ``cache_hit_alignment_tokens`` where it lets a hit end inside a block, else None.

    Only an alignment below the prefix unit (the stored groups' lcm block size) does,
    as vLLM's connector rules (``enable_partial_hash_hits``): one of a whole block (a
    sliding-window group keeps hits on its blocks) makes no partial tail worth storing.
    """
    tokens = int(alignment or 0)
    unit = math.lcm(*(group.block_size for group in groups if group.prefix_cacheable))
    return tokens if 0 < tokens < unit else None


def recomputes_last_block(vllm_config: VllmConfig) -> bool:
    """Whether the engine recomputes the last block of every prefix hit (vLLM's EAGLE block drop).

    A drafter that reads the target model's hidden states (EAGLE, EAGLE-3, MTP)
    needs those of the tokens before the first it computes, so the engine drops
    the last block of its own prefix-cache hits, unless told not to
    (``disable_eagle_block_drop``); a store hit must stop short the same way.
    vLLM versions without the switch drop it whenever the drafter is such a one.
    """
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is None:
        return False
    block_drop = getattr(speculative, "use_eagle_block_drop", None) or speculative.use_eagle
    return bool(block_drop())


def groups_of(
    kv_cache_config: KVCacheConfig, mamba_mode: str | None, dcp_size: int = 1
) -> tuple[GroupSpec, ...]:
    """One :class:`GroupSpec` per engine KV-cache group, in the engine's order (DCP-resolved block sizes)."""
    return tuple(
        _group_spec(group.kv_cache_spec, mamba_mode, dcp_size) for group in kv_cache_config.kv_cache_groups
    )


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
    pp_rank: int  # this worker's (the scheduler: 0)
    layer_names: tuple[tuple[str, ...], ...]  # per engine group
    num_blocks: int
    layout_name: str
    #: where a hit may end (vLLM's ``cache_hit_alignment_tokens``: below a prefix unit
    #: when the engine allows partial hits); None: whole prefix units
    hit_alignment: int | None = None
    #: the engine recomputes the last block of a hit (:func:`recomputes_last_block`)
    recomputes_last_block: bool = False
    #: TP ranks that hold byte-identical objects (MLA: every rank; GQA with more ranks
    #: than KV heads: tp_size // heads); they share one key, every one of them loads it
    tp_replicas: int = 1
    #: rank-local objects (the default) or store shards engines of several TP sizes share
    store_format: StoreFormat = StoreFormat()
    pp_size: int = 1
    #: context parallelism: each PCP/DCP rank holds its share of a block's tokens, keyed
    #: ``@pcp{r}@dcp{r}`` as in vLLM's connector (a DCP rank is ``tp_rank % dcp_size``)
    pcp_size: int = 1
    pcp_rank: int = 0  # this worker's (the scheduler: 0)
    dcp_size: int = 1
    #: what of the engine's configuration decides the bytes of its objects (dtypes,
    #: revision), for the seals' fingerprint; :meth:`kv_cache` adds the layout, the worker
    #: its layers' shapes
    byte_facts: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(
        cls,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        settings: ConnectorSettings,
        pp_rank: int = 0,
        pcp_rank: int = 0,
    ) -> EngineCache:
        mamba_mode = getattr(vllm_config.cache_config, "mamba_cache_mode", None)
        parallel = vllm_config.parallel_config
        pcp, dcp = context_parallel(parallel)
        groups = groups_of(kv_cache_config, mamba_mode, dcp)
        alignment = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
        tp_size = int(parallel.tensor_parallel_size)
        kv_heads = int(vllm_config.model_config.get_total_num_kv_heads())
        layout_name = str(getattr(kv_cache_config, "kv_cache_layout", None) or "unresolved")
        stored = sum(1 for g in groups if g.prefix_cacheable)
        # None is only the field's default: the engine core resolves it before it makes a connector
        if kv_cache_config.hash_block_size is None:
            raise ConfigError(
                "vLLM's kv_cache_config has no hash_block_size (not resolved by the engine core)"
            )
        if pcp > 1 and stored > 1:
            raise ConfigError(
                f"prefill_context_parallel_size={pcp} with {stored} stored KV-cache groups (a hybrid model): "
                "neither kvpipe nor vLLM's connector stores that"
            )
        return cls(
            groups=groups,
            hash_block_size=int(kv_cache_config.hash_block_size),
            model=key_model_name(vllm_config.model_config.model),
            cache_prefix=settings.cache_prefix,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=int(parallel.pipeline_parallel_size),
            pcp_size=pcp,
            pcp_rank=pcp_rank,
            dcp_size=dcp,
            layer_names=tuple(tuple(g.layer_names) for g in kv_cache_config.kv_cache_groups),
            num_blocks=int(kv_cache_config.num_blocks),
            layout_name=layout_name,
            hit_alignment=partial_hit_alignment(groups, alignment),
            recomputes_last_block=recomputes_last_block(vllm_config),
            tp_replicas=tp_replicas(
                kv_cache_config,
                tp_size,
                kv_heads,
                dcp,
            ),
            store_format=store_format(
                settings.requested_store_tp_size(),
                engine_shape(vllm_config, kv_cache_config, kv_heads, layout_name, settings),
                settings.store_tp_topology(),
            ),
            byte_facts=engine_facts(
                {
                    "dtype": str(vllm_config.model_config.dtype),
                    "cache_dtype": str(vllm_config.cache_config.cache_dtype),
                    "revision": getattr(vllm_config.model_config, "revision", None),
                }
            ),
        )

    store_groups: tuple[StoreGroup, ...] = field(init=False)
    #: every rank's namespace: a chunk is a hit only if every rank stored it
    lookup_shards: tuple[Shard, ...] = field(init=False)

    def __post_init__(self) -> None:
        # Validate the projection now (no memory needed): a bad config fails at start.
        every_group = self.kv_cache({g: BlockLayout(()) for g in range(len(self.groups))})
        object.__setattr__(self, "store_groups", storable_groups(every_group))
        stored = self.kv_cache({g.engine_group: BlockLayout(()) for g in self.store_groups})
        object.__setattr__(self, "lookup_shards", stored.shards)

    def namespace(
        self, key_rank: int, *, pcp_rank: int = 0, dcp_rank: int = 0, pp_rank: int | None = None
    ) -> KeyNamespace:
        """The keys of ``key_rank`` (a TP rank less its replicas, or a store shard); ``pp_rank``: this worker's."""
        return KeyNamespace(
            self.model,
            self.cache_prefix,
            tp_rank=key_rank,
            pcp_rank=pcp_rank,
            dcp_rank=dcp_rank,
            pp_rank=self.pp_rank if pp_rank is None else pp_rank,
            store_namespace=self.store_format.namespace,
        )

    @property
    def store_block_sizes(self) -> list[int]:
        """The block size of each stored group (what its staging slots are counted in)."""
        return [group.spec.block_size for group in self.store_groups]

    @property
    def chunk_namespaces(self) -> tuple[KeyNamespace, ...]:
        """Every object's namespace of one chunk and store group: what a hit needs (vLLM's lookup prefixes).

        Every store shard or distinct TP rank, every PCP rank, every PP stage; under
        DCP every TP rank, whose DCP rank is ``tp_rank % dcp_size`` (no replicas then).
        """
        pcp_ranks = range(1) if self.store_format.sharded else range(self.pcp_size)
        return tuple(
            self.namespace(rank, pcp_rank=pcp, dcp_rank=self._dcp_rank(rank), pp_rank=pp)
            for pcp in pcp_ranks
            for rank in self.key_ranks
            for pp in range(self.pp_size)
        )

    def rank_namespaces(self, tp_rank: int) -> tuple[KeyNamespace, ...]:
        """The namespaces of the objects rank ``tp_rank`` (of this worker's PCP rank and PP stage) stores."""
        return tuple(
            self.namespace(key, pcp_rank=self.pcp_rank, dcp_rank=self._dcp_rank(tp_rank))
            for key in self.rank_keys(tp_rank)
        )

    def _dcp_rank(self, tp_rank: int) -> int:
        return tp_rank % self.dcp_size if self.dcp_size > 1 else 0

    @property
    def key_ranks(self) -> range:
        """Every distinct ``tp_rank`` of keys: the store shards, or the ranks less their replicas."""
        if self.store_format.store_tp_size is not None:
            return range(self.store_format.store_tp_size)
        return range(self.tp_size // self.tp_replicas)

    @property
    def shards_per_rank(self) -> int:
        """How many objects of a block one rank holds: its store shards (one unless sharded)."""
        size = self.store_format.store_tp_size
        return 1 if size is None else size // self.tp_size

    def rank_keys(self, tp_rank: int) -> range:
        """The ``tp_rank``s of rank ``tp_rank``'s keys: its store shards, or the one its replicas share."""
        if self.store_format.sharded:
            return range(tp_rank * self.shards_per_rank, (tp_rank + 1) * self.shards_per_rank)
        return range(tp_rank // self.tp_replicas, tp_rank // self.tp_replicas + 1)

    @property
    def _writers_per_pcp(self) -> int:
        """The ranks of one PCP rank that put: every TP rank if sharded, else one per set of replicas."""
        return self.tp_size if self.store_format.sharded else self.tp_size // self.tp_replicas

    def writer(self, tp_rank: int) -> int:
        """Who rank ``tp_rank`` (of this worker's PCP rank) is among the ranks that put (its KV events' rank)."""
        within = tp_rank if self.store_format.sharded else tp_rank // self.tp_replicas
        return self.pcp_rank * self._writers_per_pcp + within

    @property
    def writers(self) -> range:
        """Every rank that puts, as :meth:`writer` names it."""
        return range(self.pcp_size * self._writers_per_pcp)

    @property
    def putting_ranks(self) -> list[tuple[int, int]]:
        """Every (writer, pp rank) whose chunk reports together say a chunk is stored whole."""
        return [(writer, pp) for writer in self.writers for pp in range(self.pp_size)]

    def puts_from(self, tp_rank: int) -> bool:
        """Whether rank ``tp_rank`` puts its objects: of ranks with identical bytes, the first does.

        (vLLM's connector stripes a chunk's puts over the replicas; the keys and
        bytes are the same either way, and one writer keeps every save request whole.)
        Store shards are never replicated: every rank puts its own.
        """
        return tp_rank % self.tp_replicas == 0

    def kv_cache(self, layouts: Mapping[int, BlockLayout]) -> KVCache:
        """The cache with ``layouts`` (by engine group) in every namespace of a chunk (:attr:`chunk_namespaces`)."""
        return self._cache(tuple(Shard(namespace, dict(layouts)) for namespace in self.chunk_namespaces))

    def rank_cache(self, tp_rank: int, shard_layouts: Sequence[Mapping[int, BlockLayout]]) -> KVCache:
        """Rank ``tp_rank``'s cache: its namespaces (:meth:`rank_namespaces`), each over its own layouts."""
        namespaces = self.rank_namespaces(tp_rank)
        if len(shard_layouts) != len(namespaces):
            raise ValueError(
                f"rank {tp_rank} holds {len(namespaces)} store shards, got layouts for {len(shard_layouts)}"
            )
        return self._cache(
            tuple(
                Shard(namespace, dict(layouts))
                for namespace, layouts in zip(namespaces, shard_layouts, strict=True)
            )
        )

    def _cache(self, shards: tuple[Shard, ...]) -> KVCache:
        facts = (*self.byte_facts, *engine_facts({"layout": self.layout_name}))
        return KVCache(self.groups, self.hash_block_size, shards, self.hit_alignment, facts)


def engine_shape(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    kv_heads: int,
    layout_name: str,
    settings: ConnectorSettings,
) -> EngineShape:
    """What of the engine decides its store format (:mod:`.store_format`)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    parallel = vllm_config.parallel_config
    stored = [
        group.kv_cache_spec
        for group in kv_cache_config.kv_cache_groups
        if getattr(group.kv_cache_spec, "prefix_cacheable", True)
    ]
    return EngineShape(
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        kv_heads=kv_heads,
        layout_name=layout_name,
        one_plain_attention_group=len(stored) == 1 and type(stored[0]) is FullAttentionSpec,
        context_parallel=context_parallel(parallel) != (1, 1),
        cross_layer_blocks=settings.enable_cross_layers_blocks,
    )


def context_parallel(parallel: Any) -> tuple[int, int]:
    """The engine's (PCP, DCP) sizes, 1 where its vLLM has no such setting."""
    return (
        int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
        int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
    )


def tp_replicas(kv_cache_config: KVCacheConfig, tp_size: int, kv_heads: int, dcp_size: int) -> int:
    """How many TP ranks hold byte-identical objects: vLLM's connector's replication factor.

    A mamba state is rank-specific (1); an MLA latent is the same on every rank
    (``tp_size``); attention heads are replicated when there are more ranks than
    KV heads (``tp_size // kv_heads``); DCP splits the context, so nothing is
    replicated (1). Groups that disagree cannot share one key per chunk: refused.
    """
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    def factor(spec: Any) -> int:
        inner = tuple(spec.kv_cache_specs.values()) if hasattr(spec, "kv_cache_specs") else (spec,)
        if dcp_size > 1 or any(isinstance(s, MambaSpec) for s in inner):
            return 1
        if all(isinstance(s, MLAAttentionSpec) for s in inner):
            return tp_size
        return max(1, tp_size // max(1, kv_heads))

    factors = {
        factor(group.kv_cache_spec)
        for group in kv_cache_config.kv_cache_groups
        if getattr(group.kv_cache_spec, "prefix_cacheable", True)
    }
    if len(factors) > 1:
        raise ConfigError(
            f"the stored KV-cache groups replicate over TP ranks differently ({sorted(factors)} ranks per copy "
            f"at tensor_parallel_size {tp_size}): kvpipe keys every group of a chunk alike"
        )
    return factors.pop() if factors else 1


# The memory store serves in-process engines only (scheduler and worker share it), and
# every connector of the process shares it: none of them owns it, none closes it.
_MEMORY_STORES: dict[str, MemoryStore] = {}


def store_config(settings: ConnectorSettings) -> AnyStoreConfig:
    """The connector's store configuration: ``store``, or vLLM's Mooncake JSON when it is unset."""
    if settings.store is not None:
        return settings.store
    return MooncakeStoreConfig.model_validate(MooncakeSettings.from_vllm_env().model_dump())


def open_store(
    settings: ConnectorSettings, *, mount_segment: bool, log: OperationLog | None = None
) -> tuple[Store, bool]:
    """The connector's store, and whether the connector owns it (closes it at shutdown).

    ``store`` unset: vLLM's Mooncake JSON (``MOONCAKE_CONFIG_PATH``), so existing
    vLLM setups work as they are. ``mount_segment=False`` (the scheduler: it only
    asks what exists) lends the store no memory. ``log`` records the store calls.
    """
    config = store_config(settings)
    if isinstance(config, MemoryStoreConfig):
        key = config.model_dump_json()
        if key not in _MEMORY_STORES:
            _MEMORY_STORES[key] = config.open()
        return guarded(_MEMORY_STORES[key], config.breaker, log), False
    if config.master == "spawn":
        raise ConfigError(
            "kv_connector_extra_config.store.master: 'spawn' cannot serve vLLM (the scheduler and the "
            "worker must share one master); give 'host:port' of a running mooncake_master, got 'spawn'"
        )
    return connect(config, mount_segment=mount_segment, shared=True, log=log), True
