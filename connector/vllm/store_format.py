"""Which objects an engine stores: one per rank, or shards of a store TP size that engines of several TP sizes share.

By default an object is one engine rank's block (``@tp_rank:{rank}``), so only
engines of one TP size share a cache. vLLM 0.32's ``MooncakeStoreConnector`` lets
a TP 4 prefill fleet and a TP 2 decode fleet share one: with ``store_tp_size``
(or ``enable_store_tp_lcm`` and the lcm of ``prefill_tp_sizes``) every object
holds the KV heads of one *store shard*, ``num_kv_heads / store_tp_size`` of
them, and a rank stores and loads the ``store_tp_size / tp_size`` shards its
heads cover. This module makes the choice vLLM's connector makes (its worker's
``_select_store_layout``), so the two name and fill every object alike:

- **sharded** (``@store_tp:{S}@store_pp:{P}@store_format:tp_shared_{lbhnc|lbnhc}``):
  when ``S`` is a multiple of ``tp_size``, the heads divide by ``S``, the one stored
  group is plain full attention, there is no PCP/DCP, and the KV layout is LBHNC
  (a shard's heads are one run per layer) or LBNHC (one run per token per layer,
  many small transfers: a warning); cross-layer blocks (``BL*`` layouts, or
  ``enable_cross_layers_blocks``) never are;
- **replicated MQA** (``@store_pp:{P}@store_format:tp_shared_mqa``): one KV head,
  which every rank holds whole: rank-local objects every TP size shares;
- **compatibility** (``@store_pp:{P}@store_format:rank_local_tp{T}_layout_{L}``):
  anything else: rank-local objects in a namespace of their own, with a warning,
  so an engine that cannot share never reads another layout's bytes.

Without ``store_tp_size`` the namespace is empty: today's rank-local keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

log = structlog.get_logger("kvpipe.connector.vllm")

#: KV layouts whose heads a store shard can take, by the format's name in keys
SHARDED_FORMATS = {"LBHNC": "tp_shared_lbhnc", "LBNHC": "tp_shared_lbnhc"}


@dataclass(frozen=True)
class StoreFormat:
    """The objects' namespace and, for sharded objects, the store TP size."""

    namespace: str = ""
    #: set: each object is one store shard's KV heads (``tp_rank`` in keys is the shard)
    store_tp_size: int | None = None

    @property
    def sharded(self) -> bool:
        return self.store_tp_size is not None


@dataclass(frozen=True)
class EngineShape:
    """What of an engine decides its store format."""

    tp_size: int
    pp_size: int
    kv_heads: int  # in all, over every rank
    layout_name: str  # vLLM's resolved KVCacheLayout, by name
    #: exactly one stored group, and it is plain full attention (not MLA, not a window)
    one_plain_attention_group: bool
    context_parallel: bool  # PCP or DCP above 1
    cross_layer_blocks: bool = False  # vLLM's enable_cross_layers_blocks


def store_format(requested: int | None, engine: EngineShape, topology: object = None) -> StoreFormat:
    """The format for a store TP size ``requested`` (None: not asked for), as vLLM's connector picks it.

    ``topology`` is what the user gave (``store_tp_size`` or ``prefill_tp_sizes``),
    named in the warning when the engine cannot share.
    """
    if requested is None:
        return StoreFormat()
    shardable = (
        requested >= engine.tp_size
        and requested % engine.tp_size == 0
        and engine.layout_name in SHARDED_FORMATS
        and engine.one_plain_attention_group
        and not engine.context_parallel
        and not engine.cross_layer_blocks
    )
    if shardable and engine.kv_heads % requested == 0:
        if engine.layout_name == "LBNHC":
            log.warning(
                "store TP sharding over the LBNHC KV layout: one transfer per token per layer, "
                "slower puts and gets than LBHNC"
            )
        name = SHARDED_FORMATS[engine.layout_name]
        return StoreFormat(f"@store_tp:{requested}@store_pp:{engine.pp_size}@store_format:{name}", requested)
    if shardable and engine.kv_heads == 1:
        log.info("store TP sharing of a single KV head: replicated MQA objects", store_tp_size=requested)
        return StoreFormat(f"@store_pp:{engine.pp_size}@store_format:tp_shared_mqa")
    namespace = (
        f"@store_pp:{engine.pp_size}@store_format:rank_local_tp{engine.tp_size}_layout_{engine.layout_name}"
    )
    log.warning(
        "store TP sharing is off for this engine: rank-local objects in a namespace of their own",
        requested=topology,
        tp_size=engine.tp_size,
        kv_heads=engine.kv_heads,
        layout=engine.layout_name,
        namespace=namespace,
    )
    return StoreFormat(namespace)
