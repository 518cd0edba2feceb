"""``kv_connector_extra_config``: the connector's settings, validated, with YAML defaults."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from kvpipe.connector.store.configs import ByteCount, StoreConfig, without_store_tag
from kvpipe.pipeline import BuildError
from kvpipe.pipeline.config import describe_validation_error, load_yaml, one_line
from kvpipe.pipeline.priority import MAX_NICE
from kvpipe.stages import MAX_BUFFERS_PER_CALL, Integrity, StrictFlag
from kvpipe.stages.errors import ConfigError
from kvpipe.stages.retention import PINNED_SHARE, CapacityReader, PinnedBudget
from kvpipe.stages.store import MAX_SOFT_PIN_TTL_S

log = structlog.get_logger("kvpipe.connector.vllm")

#: 256 chunks of 128 tokens: one step's saves of a full batch, with the last steps' still in flight
DEFAULT_STAGING_TOKENS = 32768


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config``, validated; errors name the field and the value.

    Each field's ``description`` is its one documentation: docs/vllm-connector.md's
    settings table is :func:`markdown_table` of them (a test holds the page to it).
    """

    model_config = ConfigDict(extra="forbid")

    store: StoreConfig | None = Field(
        None,
        description=(
            'The store: `{kind: mooncake, master: "host:port", metadata_server: ..., ...}` '
            "(the keys of a `kvpipe run` config's `store:` section) or `{kind: memory}` "
            "(in-process, for tests). Left out, the store comes from vLLM's Mooncake JSON "
            "(`MOONCAKE_CONFIG_PATH`), so an existing vLLM deployment works as it is."
        ),
    )
    enable_group_semantics: StrictFlag = Field(
        False,
        description=(
            "Put every object of a chunk under one Mooncake group id, so the store keeps and "
            'evicts the chunk whole. true or false only ("flase" is an error).'
        ),
    )
    cache_prefix: str = Field(
        "",
        description="A namespace in every key and group id: deployments with different prefixes share no objects.",
    )
    queue_capacity: int = Field(
        1024,
        gt=0,
        description=(
            "Requests each pipeline's entry holds: a save past it is dropped (the engine never "
            "waits), a load waits."
        ),
    )
    max_buffers_per_call: int = Field(
        MAX_BUFFERS_PER_CALL,
        gt=0,
        description=(
            "Buffers one put call sends at most; a batch over it is split (more buffers to one peer "
            "make Mooncake fail with -800)."
        ),
    )
    staging_tokens: int = Field(
        DEFAULT_STAGING_TOKENS,
        gt=0,
        description=(
            "Tokens of every stored group the worker's staging area holds, whatever the block size "
            "(a count of blocks would hold 8x fewer tokens at 16-token blocks than at 128). "
            "A step's saves that do not fit are dropped and counted; a load lands in them too "
            "(`load_via_staging`): a hit stops at what they hold less the loads already planned "
            "or in flight (the engine computes the rest), and a load that finds saves holding "
            "some waits for them, by its `load_deadline_s`."
        ),
    )
    staging_blocks: int | None = Field(
        None, gt=0, description="The staging slot count itself; given, it overrides `staging_tokens`."
    )
    save_deadline_s: float = Field(
        10.0,
        gt=0,
        description="Past it, a save job starts no new store call, so a stuck save gives its staging slots back.",
    )
    load_deadline_s: float = Field(
        5.0,
        gt=0,
        description=(
            "Past it a load is a miss, recomputed: its request waits no longer, whatever the store "
            "call in flight does (with `load_via_staging`), and the job starts no new store call."
        ),
    )
    lookup_wait_for_saves_s: float = Field(
        1.0,
        ge=0,
        description=(
            "How long a lookup may wait for this engine's own saves: a waiting request whose hit a "
            "chunk still being saved would extend (the engine computed it a moment ago and lost it "
            "from its own cache since: a prefix-cache reset, an eviction, a preemption) is told to ask "
            "again next step until every rank has reported the chunk, stored or not, or this long after "
            "its save was planned; it then loads instead of computing again. About a busy engine's "
            "save-to-visible p99 (`kvpipe bench save-visible`). 0: never wait, a miss."
        ),
    )
    remote_prefill_wait_s: float = Field(
        5.0,
        ge=0,
        description=(
            "Prefill and decode on different engines (docs/disaggregation.md): how long a decode "
            "engine's request whose transfer parameters name a prefill engine's saves waits for them "
            "to be visible in the store, told to ask again each step (no step waits). Past it the "
            "request takes what is there and computes the rest, counted and logged. 0: never wait."
        ),
    )
    load_via_staging: StrictFlag = Field(
        True,
        description=(
            "true: a load lands in staging slots, is checked there and is copied into the engine's "
            "blocks on the engine's thread, so a load past `load_deadline_s` is given up while the "
            "store may still write its slots, and a byte that fails its check never touches the "
            "engine's blocks. false (a CPU cache; a device cache always stages): straight into the "
            "engine's blocks, one copy less, but a load cannot be given up: a store node cut off "
            "by the network holds its requests until the transfer fails (41.7 s measured)."
        ),
    )
    save_nice: int = Field(
        10,
        ge=0,
        le=MAX_NICE,
        strict=True,
        description=(
            f"How much nicer than the engine's threads the save pipeline's run (Linux; 0 to {MAX_NICE}). "
            "10 is a CPU share, not a yield: on a core both want, Linux weighs nice 10 against 0 as 110 "
            "to 1024, so saves get ~10% of it and land while the engine stays busy. At 19 (a weight of "
            "15) an engine that kept both cores busy left them nothing: the demo's second pass, right "
            "after the first, found none of its saves (0 of 1,792 tokens; all of them at 10 and at 5, "
            "pass 1 as fast within noise), until its lookups waited for the engine's own saves "
            "(`lookup_wait_for_saves_s`): now all of them at 0, 10 and 19. On an engine kept busy (`kvpipe bench save-visible`), another "
            "process found a save's objects within 0.21-0.57 s at p99 at 10 (0: 0.18-0.26 s; 19: 0.34-0.38 s). "
            "0: the engine's weight."
        ),
    )
    load_nice: int = Field(
        0,
        ge=0,
        le=MAX_NICE,
        strict=True,
        description=(
            f"How much nicer than the engine's threads the load pipeline's run (Linux; 0 to {MAX_NICE}): "
            "an async load trades the request waiting for it against the requests decoding beside it. "
            "0: loads take the CPU they can, for the loading request's first token; 10: loads take a "
            "share, so decode steps that run beside a load stay closer to those without. `kvpipe bench "
            "vllm-loads` (8x512 model, 2 cores, 4 requests decoding while 4 load a 1,024-token prefix): "
            "decode steps beside a load p50 / p99 21.5 / 47.6 ms at 0 and 10.8 / 23.5 ms at 10 (none "
            "loading: 7.6 / 9.9 ms), the loaders' first token at p50 87 ms at 0 and 139 ms at 10. A sync "
            "load (`load_async: false`) holds its step, so it gains nothing from a nicer load."
        ),
    )
    load_async: StrictFlag = Field(
        True,
        description=(
            "true: loads run beside the engine's steps and `get_finished` reports them, as in vLLM's "
            "connector; false: before the forward (models of one KV-cache group only)."
        ),
    )
    load_layerwise: StrictFlag = Field(
        False,
        description=(
            "Loads that run in their request's own step (`load_async: false`, or an idle engine) "
            "are read layer by layer while the forward runs (docs/layerwise.md): the engine waits "
            "before each attention layer for that layer's bytes only, so the transfer overlaps the "
            "layers before it. The objects are judged whole by the step's end, and a layer that is "
            "late or damaged fails its blocks in that step (vLLM recomputes them; nothing computed "
            "from it is stored). Models with several KV-cache groups, or mamba layers, load whole."
        ),
    )
    save_layerwise: StrictFlag = Field(
        False,
        description=(
            "A step's saves are written layer by layer while its forward runs (docs/layerwise.md): "
            "their objects are reserved in the store (invisible) before the forward, each layer "
            "is written as soon as the forward has computed it, and at the step's end the objects "
            "are sealed and made visible, so a save lands one layer's transfer after the forward "
            "instead of a whole transfer after it. A step that fails leaves nothing visible."
        ),
    )
    load_sync_when_idle: StrictFlag = Field(
        True,
        description=(
            "With async loads, a load that no running request would wait for (an idle engine) runs "
            "before the forward all the same, so its request computes in that step. Hybrid models "
            "load async always."
        ),
    )
    save_decode_cache: StrictFlag = Field(
        False,
        description=(
            "Also store chunks completed while decoding (rarely shared: off, as in vLLM's connector). "
            "A `kv_consumer` stores nothing unless this is true."
        ),
    )
    enable_lookup: StrictFlag = Field(
        True,
        description=(
            "As vLLM's connector: false: the engine never looks the store up (saves still go out "
            "unless it is a `kv_consumer`); a `kv_consumer` that neither looks up nor saves decode "
            "chunks is capacity-only: it lends the store its segment and transfers nothing."
        ),
    )
    integrity: Integrity = Field(
        Integrity.VERIFY,
        description=(
            "Seals (docs/integrity.md). `verify`: every put stores its object's checksum and "
            "configuration fingerprint beside it, and every load checks them; `required`: also, a "
            "chunk without seals (vLLM's connector wrote it) is a miss; `off`: sizes only, as vLLM's connector."
        ),
    )
    retention: StrictFlag = Field(
        True,
        description=(
            "Retention (docs/retention.md): a chunk asked for by `retention_min_requests` requests is "
            "stored soft-pinned for `retention_pin_ttl_s`, so one-off prompts evict around it."
        ),
    )
    retention_min_requests: int = Field(
        2,
        ge=1,
        strict=True,
        description="Requests that must ask for a chunk before it is stored soft-pinned.",
    )
    retention_pin_ttl_s: float = Field(
        600.0,
        gt=0,
        le=MAX_SOFT_PIN_TTL_S,
        description=f"Seconds a soft pin lasts (at most {MAX_SOFT_PIN_TTL_S:,}).",
    )
    retention_max_pinned: ByteCount | None = Field(
        None,
        description=(
            'Bytes one worker holds soft-pinned at once (`"8GB"` or a count; 0: pin nothing). '
            f"null: {PINNED_SHARE} of the store's capacity (the master's mounted segments, read at "
            "start: docs/retention.md) shared among the workers that pin, `retention_writers` engines "
            "times this engine's ranks that put; where the engine lends the store memory and "
            f"`retention_writers` is null, or the capacity cannot be read, {PINNED_SHARE} of what the "
            "worker lends. Each worker logs its budget and where it came from at start."
        ),
    )
    retention_writers: PositiveInt | None = Field(
        None,
        strict=True,
        description=(
            "Engines whose workers pin into this store, alike (a fleet's replicas, a disaggregated "
            "deployment's prefill engines), for the default `retention_max_pinned`. null: an engine "
            "that lends the store memory pins in what it lends, as every engine beside it does; one "
            "that lends none (store nodes hold the memory) shares the store's capacity as the only "
            "engine that pins: give the count where several do."
        ),
    )
    store_tp_size: PositiveInt | None = Field(
        None,
        strict=True,
        description=(
            "Heterogeneous TP, as vLLM's connector has it (docs/parallel-layouts.md): objects sharded "
            "for this store TP size, which engines of several TP sizes share."
        ),
    )
    enable_store_tp_lcm: StrictFlag = Field(
        False, description="Shard for the lcm of `prefill_tp_sizes` instead of `store_tp_size`."
    )
    prefill_tp_sizes: list[PositiveInt] | None = Field(
        None, min_length=1, description="The prefill fleet's TP sizes, for `enable_store_tp_lcm`."
    )
    enable_cross_layers_blocks: bool = Field(
        False,
        description=(
            "As vLLM's connector reads it: true (vLLM's test: the text \"true\", any case) shares no "
            "store shards, and the same keys need the same choice."
        ),
    )
    config: str | None = Field(
        None,
        description=(
            "A kvpipe YAML file whose `store` and `save` sections give defaults; keys given inline override them."
        ),
    )

    @model_validator(mode="after")
    def _lcm_needs_sizes(self) -> ConnectorSettings:
        if self.enable_store_tp_lcm and self.prefill_tp_sizes is None:
            raise ValueError("enable_store_tp_lcm needs prefill_tp_sizes (a list of TP sizes), got none")
        return self

    def saves_for(self, kv_role: str | None) -> bool:
        """Whether an engine of vLLM's ``kv_role`` stores what it computes, as vLLM's connector rules.

        A ``kv_consumer`` (the decode side of a disaggregated deployment) reads what
        producers stored and stores nothing, unless ``save_decode_cache``. A consumer
        that also has ``enable_lookup: false`` transfers nothing at all: it only lends
        the store its segment (vLLM's "capacity-only" mode).
        """
        return kv_role != "kv_consumer" or self.save_decode_cache

    @property
    def waits_for_saves(self) -> bool:
        """Whether lookups wait for the engine's own saves in flight (so its workers report each save's end)."""
        return self.enable_lookup and self.lookup_wait_for_saves_s > 0

    def requested_store_tp_size(self) -> int | None:
        """The store TP size asked for: the lcm of ``prefill_tp_sizes`` or ``store_tp_size``; None: not asked."""
        if self.enable_store_tp_lcm and self.prefill_tp_sizes:
            return math.lcm(*self.prefill_tp_sizes)
        return self.store_tp_size

    def store_tp_topology(self) -> int | list[int] | None:
        """What the user gave for the store TP size, as they gave it (for messages)."""
        return self.prefill_tp_sizes if self.enable_store_tp_lcm else self.store_tp_size

    def max_pinned_bytes(
        self, lent_bytes: int, *, putting_ranks: int = 1, store_capacity: CapacityReader | None = None
    ) -> PinnedBudget:
        """The bytes one worker may hold soft-pinned, and where that figure came from.

        ``lent_bytes``: what the worker lends the store (its segment); ``putting_ranks``:
        its engine's workers that put, each pinning for its own shard; ``store_capacity``:
        reads the store's capacity in object bytes (None: unknown), asked only where the
        rule needs it. Without ``retention_max_pinned``: :data:`PINNED_SHARE` of the
        capacity over ``retention_writers`` x ``putting_ranks`` workers, unless the worker
        lends memory and ``retention_writers`` is null (then every engine is taken to lend
        as this one does, and each worker pins in what it lends: the same share of the
        store), or the capacity is unknown (then the same, from what it lends: 0 if nothing).
        """
        if not self.retention:
            return PinnedBudget(0, "retention off")
        if self.retention_max_pinned is not None:
            return PinnedBudget(self.retention_max_pinned, "retention_max_pinned")
        lent = PinnedBudget(int(lent_bytes * PINNED_SHARE), "lent")
        if self.retention_writers is None and lent_bytes > 0:
            return lent
        capacity = store_capacity() if store_capacity is not None else None
        if not capacity or capacity <= 0:
            return lent._replace(source="lent, capacity unknown")
        writers = (self.retention_writers or 1) * max(1, putting_ranks)
        return PinnedBudget(int(capacity * PINNED_SHARE) // writers, "store capacity", capacity, writers)

    def staging_slots(self, block_sizes: Sequence[int]) -> int:
        """Slots for stored groups of these block sizes: ``staging_blocks``, or ``staging_tokens`` of each."""
        if self.staging_blocks is not None:
            return self.staging_blocks
        return sum(-(-self.staging_tokens // size) for size in block_sizes)


def markdown_table() -> str:
    """docs/vllm-connector.md's settings table: a row per field, from its default and description.

    ``python -m kvpipe.connector.vllm.settings`` prints it; a test holds the page to it.
    """
    rows = ["| key | default | what it sets |", "|---|---|---|"]
    for name, field in ConnectorSettings.model_fields.items():
        default = field.default.value if isinstance(field.default, Enum) else field.default
        rows.append(f"| `{name}` | `{json.dumps(default)}` | {field.description} |")
    return "\n".join(rows) + "\n"


#: keys of vLLM's MooncakeStoreConnector for machinery kvpipe does not have: accepted, so a
#: deployment switches connectors without editing its config, and each named once, with why
VLLM_ONLY_KEYS = {
    "lookup_async": "kvpipe's scheduler asks the store itself, once per step",
    "lookup_rpc_port": "kvpipe's scheduler asks the store itself: there is no lookup RPC to its workers",
    "custom_mem_pool": "kvpipe copies device KV through host memory and allocates no device pool",
}


def settings_from(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """Validate ``extra`` (defaults from the ``config`` YAML's ``store``/``save`` sections).

    :raises ConfigError: the ``config`` file cannot be read or is no mapping, or a field
        is wrong; the message names the field (``kv_connector_extra_config.<field>``) and the value.
    """
    extra = dict(extra or {})
    for key in VLLM_ONLY_KEYS.keys() & extra.keys():
        log.info(
            "a vLLM connector setting kvpipe has no use for",
            key=key,
            value=extra.pop(key),
            why=VLLM_ONLY_KEYS[key],
        )
    document: dict[str, Any] = {}
    if extra.get("config"):
        path = Path(str(extra["config"]))
        try:
            loaded = load_yaml(path) or {}
        except BuildError as exc:
            raise ConfigError(f"kv_connector_extra_config.config: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"kv_connector_extra_config.config: {str(path)!r} must hold a mapping")
        if "store" in loaded:
            document["store"] = loaded["store"]
        save = loaded.get("save") or {}
        if not isinstance(save, dict):
            raise ConfigError(
                f"kv_connector_extra_config.config: {str(path)!r}: save: must be a mapping, got {save!r}"
            )
        known = set(ConnectorSettings.model_fields) - {"store", "config"}
        document.update({k: v for k, v in save.items() if k in known})
    document.update(extra)
    try:
        return ConnectorSettings.model_validate(document)
    except ValidationError as exc:
        raise ConfigError(
            one_line(describe_validation_error(exc, "kv_connector_extra_config", without_store_tag))
        ) from None


if __name__ == "__main__":
    print(markdown_table(), end="")
