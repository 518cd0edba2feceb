"""The connector class: the scheduler side plans lookups, loads and saves; the worker side runs them."""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpipe.pipeline import SyncPipeline
from kvpipe.stages import (
    BlockLayout,
    KeyNamespace,
    KVCache,
    LoadRequest,
    LookupRequest,
    ObjectStatus,
    Region,
    SaveRequest,
    Shard,
    StoreObject,
    default_load_graph,
    default_save_graph,
    full_chunks,
    key_model_name,
    longest_stored_prefix,
    lookup_keys,
    storable_groups,
    tail_chunks,
)
from kvpipe.stages.flags import ConfigError

from ..breaker import BreakerSettings
from ..memory import MemoryStore
from ..mooncake import MooncakeSettings, MooncakeStore
from ..stores import MemoryStoreConfig, MooncakeStoreConfig, guarded

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request
from .engine_cache import groups_of
from .messages import KVPipeMetadata, KVPipeStats
from .settings import settings_from
from .staging import StagingArea

log = structlog.get_logger("kvpipe.connector.vllm")

EXISTS = 1
LOAD_TIMEOUT_S = 60.0
STOP_DEADLINE_S = 10.0
#: keys one lookup call asks at most when it takes the waiting requests along
#: (batch_is_exist: ~0.05 ms for 32 keys, ~0.5-1 ms for 2048)
LOOKUP_BATCH_KEYS = 4096


@dataclass
class _Tracked:
    """Scheduler-side state of one running request."""

    request: Request
    saved_tokens: int | None = None  # None until it is first scheduled


class KVPipeConnector(KVConnectorBase_V1, SupportsHMA):
    """A best-effort prefix cache in Mooncake Store, fed through kvpipe's pipelines."""

    #: Live instances, for tests that look inside an in-process engine.
    instances: weakref.WeakSet[KVPipeConnector] = weakref.WeakSet()

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError("KVPipeConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        self.settings = settings_from(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        if self.is_scheduler and vllm_config.kv_transfer_config.kv_load_failure_policy == "fail":
            log.warning(
                "kv_load_failure_policy is 'fail': a load the store fails (master down, object "
                "evicted) fails its request; set 'recompute' to recompute those blocks instead"
            )
        mamba_mode = getattr(vllm_config.cache_config, "mamba_cache_mode", None)
        self.group_specs = groups_of(kv_cache_config, mamba_mode)
        self.hash_block_size = int(kv_cache_config.hash_block_size)
        self.model_name = key_model_name(vllm_config.model_config.model)
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        self.pp_rank = 0
        # Validate the projection now (no memory needed): a bad config fails at start.
        self.store_groups = storable_groups(
            self._kv_cache({g: BlockLayout(()) for g in range(len(self.group_specs))})
        )
        # every TP rank's namespace: a chunk is a hit only if all ranks stored it
        self._lookup_shards = self._kv_cache(
            {g.engine_group: BlockLayout(()) for g in self.store_groups}
        ).shards
        self.stats: Counter[str] = Counter()
        self._reported: Counter[str] = Counter()
        self.observed: deque[tuple[StoreObject, ObjectStatus]] = deque(maxlen=65536)
        self._store: Any = None
        self._lock = threading.Lock()
        # scheduler state
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: dict[str, LoadRequest] = {}
        self._local_hits: dict[str, int] = {}
        self._waiting: dict[str, Request] = {}  # not scheduled yet, in arrival order
        self._exists: dict[str, bool] = {}  # this scheduling step's lookup answers
        # worker state
        self._staging: StagingArea | None = None
        self._job_slots: dict[int, list[int]] = {}
        self._save_pipeline: SyncPipeline | None = None
        self._load_pipeline: SyncPipeline | None = None
        self._engine_kv: KVCache | None = None
        self._load_errors: set[int] = set()
        self._registered: list[int] = []
        self._store = self._open_store()
        KVPipeConnector.instances.add(self)
        log.info(
            "kvpipe connector ready",
            role="scheduler" if self.is_scheduler else "worker",
            model=self.model_name,
            groups=[g.kind.value for g in self.group_specs],
            storable=[g.engine_group for g in self.store_groups],
            hash_block_size=self.hash_block_size,
        )

    # -- shared helpers ------------------------------------------------------------------

    def _namespace(self, tp_rank: int) -> KeyNamespace:
        return KeyNamespace(
            self.model_name, self.settings.cache_prefix, tp_rank=tp_rank, pp_rank=self.pp_rank
        )

    def _kv_cache(self, layouts: Mapping[int, BlockLayout], tp_ranks: Sequence[int] | None = None) -> KVCache:
        ranks = range(self.tp_size) if tp_ranks is None else tp_ranks
        shards = tuple(Shard(self._namespace(rank), dict(layouts)) for rank in ranks)
        return KVCache(self.group_specs, self.hash_block_size, shards)

    def _open_store(self) -> Any:
        config = self.settings.store
        if isinstance(config, MemoryStoreConfig):
            return guarded(_shared_memory_store(config), config.breaker)
        if config is None:
            settings: MooncakeSettings = MooncakeSettings.from_vllm_env()
            breaker: BreakerSettings | None = BreakerSettings()
        else:
            assert isinstance(config, MooncakeStoreConfig)
            if config.master == "spawn":
                raise ConfigError(
                    "kv_connector_extra_config.store.master: 'spawn' cannot serve vLLM (the scheduler and the "
                    "worker must share one master); give 'host:port' of a running mooncake_master, got 'spawn'"
                )
            settings, breaker = config.settings(), config.breaker
        if self.is_scheduler:
            settings = settings.model_copy(update={"global_segment_size": 0})  # lookups only
        return guarded(MooncakeStore.open(settings), breaker)

    # -- scheduler side ------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._waiting[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        lookup = LookupRequest(
            request.request_id, tuple(request.block_hashes), request.num_tokens, num_computed_tokens
        )
        shards = self._lookup_shards
        keys = lookup_keys(self.store_groups, shards, self.hash_block_size, lookup)
        if not keys:
            return 0, False
        if any(key not in self._exists for key in keys):
            self._look_up(keys)
        exists = {key: self._exists.get(key, False) for key in keys}  # unanswered: a miss
        hit = longest_stored_prefix(self.store_groups, shards, self.hash_block_size, lookup, exists)
        # vLLM passes the local hit here but not to update_state_after_alloc: remember the
        # latest answer (harmless if asked again; the last call is the one that counts).
        self._local_hits[request.request_id] = num_computed_tokens
        self.stats["lookup_hit_tokens"] += max(0, hit - num_computed_tokens)
        return max(0, hit - num_computed_tokens), False

    def _look_up(self, keys: Sequence[str]) -> None:
        """One ``batch_is_exist`` for ``keys`` and those of the requests still waiting.

        vLLM asks request by request within one scheduling step. One call for all
        of them costs about what one costs (requests sharing a prefix share keys),
        where a call per request is a master round trip each, which a busy 2-core
        machine stretches to milliseconds. The answers hold for this step only.
        """
        wanted = dict.fromkeys(key for key in keys if key not in self._exists)
        for waiting in self._waiting.values():
            if len(wanted) >= LOOKUP_BATCH_KEYS:
                break
            ahead = LookupRequest(waiting.request_id, tuple(waiting.block_hashes), waiting.num_tokens)
            keys_ahead = lookup_keys(self.store_groups, self._lookup_shards, self.hash_block_size, ahead)
            wanted.update(dict.fromkeys(key for key in keys_ahead if key not in self._exists))
        asked = list(wanted)
        self.stats["lookup_calls"] += 1
        try:
            answers = self._store.batch_is_exist(asked)
        except Exception as exc:  # a lookup that cannot answer is a miss
            log.warning("lookup failed", error=str(exc))
            return
        self._exists.update((key, answer == EXISTS) for key, answer in zip(asked, answers, strict=False))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        self._waiting.pop(rid, None)
        self._tracked.setdefault(rid, _Tracked(request))
        local = self._local_hits.pop(rid, 0)
        if num_external_tokens > 0:
            block_ids = tuple(tuple(ids) for ids in blocks.get_block_ids())
            self._pending_loads[rid] = LoadRequest(
                rid, tuple(request.block_hashes), block_ids, local, local + num_external_tokens
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        so = scheduler_output
        meta = KVPipeMetadata()
        self._exists.clear()  # the step is planned: the next one asks again
        for rid in so.finished_req_ids:
            self._tracked.pop(rid, None)
            self._pending_loads.pop(rid, None)
            self._local_hits.pop(rid, None)
            self._waiting.pop(rid, None)
        for new in so.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None and tracked.saved_tokens is None:
                tracked.saved_tokens = new.num_computed_tokens  # local + loaded: never saved again
        # Loads are synchronous: a request with a pending load is scheduled in this very
        # step, new or resumed after a preemption; its load runs before the forward.
        for rid in [rid for rid in self._pending_loads if rid in so.num_scheduled_tokens]:
            meta.loads.append(self._pending_loads.pop(rid))
            self.stats["loads_planned"] += 1
        block_state = so.kv_connector_block_state
        for rid, scheduled in so.num_scheduled_tokens.items():
            tracked = self._tracked.get(rid)
            if tracked is None or block_state is None:
                continue
            request = tracked.request
            saved = tracked.saved_tokens if tracked.saved_tokens is not None else request.num_computed_tokens
            done = request.num_computed_tokens + scheduled
            hashes = tuple(request.block_hashes)
            reach = min(
                (min(done // g.spec.block_size, len(hashes) * self.hash_block_size // g.spec.block_size))
                * g.spec.block_size
                for g in self.store_groups
            )
            if reach <= saved:
                continue
            block_ids = tuple(tuple(ids) for ids in block_state.get_block_ids(rid))
            meta.saves.append(SaveRequest(rid, hashes, block_ids, done, saved, False))
            tracked.saved_tokens = reach
            self.stats["saves_planned"] += 1
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._waiting.pop(request.request_id, None)  # e.g. aborted before it was scheduled
        return False, None  # the worker copies what it saves: vLLM may free the blocks now

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: nothing must be delivered before a request goes on

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._kv_cache_config is not None
        num_blocks = int(self._kv_cache_config.num_blocks)
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - not initialised: a single rank
            tp_rank = 0
        for name, tensor in kv_caches.items():
            if tensor.shape[0] != num_blocks:
                raise ConfigError(
                    f"KV cache of layer {name!r} has shape {tuple(tensor.shape)}: kvpipe needs the block "
                    f"dimension ({num_blocks} blocks) first, as vLLM's CPU layout has it"
                )
        # the engine's memory, once per storage
        storages: dict[int, int] = {}
        for tensor in kv_caches.values():
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        self._staging = StagingArea(kv_caches, self._group_layers(kv_caches), self.settings.staging_blocks)
        arena = self._staging.arena
        storages[arena.data_ptr()] = arena.numel()
        for address, nbytes in storages.items():
            code = self._store.register_buffer(address, nbytes)
            if code != 0:
                log.warning("register_buffer failed", address=hex(address), nbytes=nbytes, code=code)
            else:
                self._registered.append(address)
        self._engine_kv = self._kv_cache(self._engine_layouts(kv_caches), [tp_rank])
        staging_kv = self._kv_cache(self._staging.layouts(), [tp_rank])
        self._save_pipeline = SyncPipeline(
            default_save_graph(
                staging_kv,
                self._store,
                enable_group_semantics=self.settings.enable_group_semantics,
                max_buffers_per_call=self.settings.max_buffers_per_call,
                observer=self._observe,
            ),
            queue_capacity=self.settings.queue_capacity,
            when_full="drop",
            name="kvpipe-save",
            job_deadline_s=self.settings.save_deadline_s,
        ).start()
        self._load_pipeline = SyncPipeline(
            default_load_graph(
                self._engine_kv,
                self._store,
                load_observer=self._load_observed,
                max_buffers_per_call=self.settings.max_buffers_per_call,
            ),
            queue_capacity=self.settings.queue_capacity,
            when_full="wait",
            name="kvpipe-load",
            job_deadline_s=self.settings.load_deadline_s,
        ).start()

    def _group_layers(self, kv_caches: Mapping[str, torch.Tensor]) -> dict[int, list[str]]:
        """Per storable engine group, its layers in the engine's order: the order of an object's bytes."""
        assert self._kv_cache_config is not None
        layers = {}
        for group in self.store_groups:
            names = set(self._kv_cache_config.kv_cache_groups[group.engine_group].layer_names)
            layers[group.engine_group] = [name for name in kv_caches if name in names]
        return layers

    def _engine_layouts(self, kv_caches: Mapping[str, torch.Tensor]) -> dict[int, BlockLayout]:
        """Per storable engine group, one region per layer: loads land straight in the engine's blocks."""
        layouts = {}
        for group, names in self._group_layers(kv_caches).items():
            tensors = [kv_caches[name] for name in names]
            layouts[group] = BlockLayout(
                tuple(Region(t.data_ptr(), t.stride(0) * t.element_size()) for t in tensors)
            )
        return layouts

    def _observe(self, record: StoreObject, status: ObjectStatus) -> None:
        self.observed.append((record, status))
        self.stats[f"objects_{status.value}"] += 1

    def _load_observed(self, request_id: str, failed_block_ids: frozenset[int]) -> None:
        if failed_block_ids:
            with self._lock:
                self._load_errors.update(failed_block_ids)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVPipeMetadata) or not meta.loads or self._load_pipeline is None:
            return
        jobs = [self._load_pipeline.submit(load) for load in meta.loads]
        for job in jobs:
            load: LoadRequest = job.item
            if not job.wait(LOAD_TIMEOUT_S):
                log.warning("load timed out", request_id=load.request_id)
                with self._lock:
                    for ids in load.block_ids:
                        self._load_errors.update(ids)
            self.stats["loads"] += 1
            self.stats["chunks_loaded"] += job.counts.get("loaded", 0)
            self.stats["chunks_load_failed"] += job.counts.get("failed", 0)
        self._load_pipeline.completed()  # the waited jobs; nothing else to collect

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        self._reap()
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVPipeMetadata) or self._save_pipeline is None:
            return
        for save in meta.saves:
            self._stage(save)

    def _stage(self, save: SaveRequest) -> None:
        """Copy the save's chunks into free staging slots and submit it; drop it if slots run out."""
        assert self._engine_kv is not None and self._save_pipeline is not None
        plan: list[tuple[int, int, int]] = []  # (engine group, chunk index, engine block)
        for group in self.store_groups:
            bs = group.spec.block_size
            for chunk in (
                *full_chunks(save, group, self.hash_block_size),
                *tail_chunks(save, group, self.hash_block_size),
            ):
                # the block its last token falls in (a tail's block is partly filled)
                plan.append((group.engine_group, (chunk.tokens_end - 1) // bs, chunk.block_id))
        staging = self._staging
        if not plan or staging is None:
            return
        if len(plan) > staging.free:
            self.stats["saves_dropped_no_staging"] += 1
            return
        slots = staging.take(len(plan))
        staged: list[list[int]] = [[] for _ in save.block_ids]
        for (engine_group, index, block), slot in zip(plan, slots, strict=True):
            ids = staged[engine_group]
            if len(ids) <= index:
                ids.extend([slot] * (index + 1 - len(ids)))
            ids[index] = slot
            staging.copy_in(engine_group, slot, block)
        request = SaveRequest(
            save.request_id,
            save.block_hashes,
            tuple(tuple(ids) for ids in staged),
            save.num_computed_tokens,
            save.num_saved_tokens,
            save.finished,
        )
        job = self._save_pipeline.submit(request)
        self.stats["saves_submitted"] += 1
        self._job_slots[job.id] = slots
        if job.done:
            self._reap()

    def _reap(self) -> None:
        """Free the staging slots of completed save jobs and count their outcomes."""
        if self._save_pipeline is None or self._staging is None:
            return
        for job in self._save_pipeline.completed():
            self._staging.give_back(self._job_slots.pop(job.id, ()))
            self.stats[f"save_jobs_{job.outcome.value if job.outcome else 'unknown'}"] += 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._reap()
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPipeStats(data=dict(data or {}))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What the worker counted since the last call, or None when nothing happened."""
        current = Counter(self.stats)
        delta = {name: value for name, value in (current - self._reported).items() if value}
        self._reported = current
        return KVPipeStats(data=delta) if delta else None

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every submitted save has completed (for tests and shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._job_slots and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.01)
        self._reap()
        return not self._job_slots

    def shutdown(self) -> None:
        for pipeline in (self._save_pipeline, self._load_pipeline):
            if pipeline is not None:
                try:
                    pipeline.stop(STOP_DEADLINE_S)
                except Exception as exc:  # noqa: BLE001
                    log.warning("pipeline stop failed", error=str(exc))
        self._reap()
        self._save_pipeline = self._load_pipeline = None
        store, self._store = self._store, None
        if store is not None and not isinstance(store, MemoryStore):
            for address in self._registered:
                try:
                    store.unregister_buffer(address)
                except Exception:  # noqa: BLE001, S110
                    pass
            store.close()
        self._registered.clear()


# The memory store exists for in-process use only (scheduler and worker share it).
_MEMORY_STORES: dict[str, MemoryStore] = {}


def _shared_memory_store(config: MemoryStoreConfig) -> MemoryStore:
    key = config.model_dump_json()
    if key not in _MEMORY_STORES:
        _MEMORY_STORES[key] = config.build()
    return _MEMORY_STORES[key]
