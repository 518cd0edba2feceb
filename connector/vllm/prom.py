"""kvpipe's Prometheus series in vLLM's ``/metrics``, built from :class:`~.messages.KVPipeStats`.

vLLM builds this once in its logger process (``build_prom_metrics``) and feeds
it every engine step's stats. Every series is named ``kvpipe:...`` (vLLM's own
are ``vllm:...``, so none can clash) and carries vLLM's labels (``model_name``,
``engine``). The series, and where each comes from:

Store calls (:mod:`kvpipe.connector.store.metered`), labels ``operation`` (``exist``,
``put``, ``get``, ``remove``) and ``status`` (``ok``, ``error``):
``kvpipe:store_operation_seconds`` (histogram), ``kvpipe:store_operation_keys_total``,
``kvpipe:store_operation_bytes_total``, ``kvpipe:store_operation_failed_keys_total``;
``kvpipe:store_operation_records_dropped_total`` counts calls whose record found
the log full.

The connector's counters (:data:`COUNTERS`, :data:`LABELLED`), each ``_total``;
``kvpipe:stage_dropped_total`` (labels ``pipeline``, ``stage``: items a stage
took out of the stream, e.g. the filter's objects the store already has; ``entry``
for saves refused at a full queue).

Gauges, the latest reading of every role summed over ranks (the breaker: the
worst of them): ``kvpipe:stage_queue_depth`` (labels ``pipeline``, ``stage``),
``kvpipe:staging_slots_in_use``, ``kvpipe:staging_slots``, ``kvpipe:breaker_state``
(label ``role``; 0 closed, 1 half-open, 2 open).
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)

from .messages import (
    BREAKER_STATE,
    GAUGES,
    OPS,
    QUEUE_DEPTH,
    STAGE_DROPPED,
    STAGING_SLOTS,
    STAGING_SLOTS_IN_USE,
    split_per_stage,
)

PREFIX = "kvpipe:"

#: The counters the roles keep, and what each counts (the README's table is this one).
COUNTERS: dict[str, str] = {
    "saves_planned": "Save requests the scheduler planned (chunks an engine step completes).",
    "saves_submitted": "Save requests a worker staged and handed to its save pipeline.",
    "saves_dropped_no_staging": "Save requests dropped because no staging slot was free (a step never waits).",
    "saves_landed": "Save requests whose every object was stored.",
    "save_landing_ms": (
        "Milliseconds from the step that computed a save to its objects stored, summed over saves_landed: "
        "their mean is how long another replica waits before it can hit what a step computed."
    ),
    "lookup_calls": "batch_is_exist calls of the scheduler's lookups (one per scheduling step at most).",
    "lookup_hit_tokens": "Tokens lookups found in the store beyond the engine's own prefix cache.",
    "lookups_deferred": "Lookups told to ask again because another request was loading the same prefix.",
    "lookups_missed_after_failed_load": "Lookups answered as misses because the request's load had failed.",
    "loads_planned": "Loads the scheduler planned.",
    "loads_sync": "Loads run before the forward of the step computing their request (nothing else ran).",
    "loads": "Loads a worker submitted.",
    "loads_failed": "Loads that failed (the engine recomputes their blocks).",
    "loads_failed_no_staging": "Loads failed at once for want of staging slots (device caches).",
    "loads_spared": "Requests that waited on another request's load of their prefix and then hit it locally.",
    "chunks_loaded": "Chunks (one store group, one rank) loaded into the engine's blocks.",
    "chunks_load_failed": "Chunks whose load failed.",
    "chunks_loaded_from_others": "Chunks loaded that this engine did not put (another replica's saves).",
    "chunks_verified": "Chunks loaded whose seal vouched for their bytes (checksum and configuration).",
    "chunks_unverified": "Chunks loaded without a seal (vLLM's connector wrote them, or the seal was lost).",
    "seals_failed": "Objects stored whose seal could not be stored (loads will find them unverified).",
    "events_dropped": "KV events not published because the chunks awaiting their reports were too many.",
}
#: Counter families whose suffix is a label: ``objects_put`` -> ``kvpipe:objects_total{status="put"}``.
LABELLED: dict[str, tuple[str, str]] = {
    "objects": ("status", "Save-path objects by final status: put, existing, failed, throttled."),
    "save_jobs": ("outcome", "Save jobs by outcome: ok, partial, failed, dropped."),
    "integrity_failures": (
        "reason",
        "Loaded chunks refused by their seal, their blocks recomputed: corrupt (bytes not as sealed; "
        "removed), foreign (another configuration wrote them), unsealed (no seal under integrity: required).",
    ),
}
RECORDS_DROPPED = "store_operation_records_dropped"
OPERATION_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


def unregister_kvpipe_metrics() -> None:
    """Drop the series an earlier engine of this process registered (vLLM does the same for its own).

    Without it, a second engine in one process (a restart, a test) fails with
    "Duplicated timeseries" when it registers the same names.
    """
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - as vLLM's unregister_vllm_metrics
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)


class KVPipePromMetrics(KVConnectorPromMetrics):
    """Registers kvpipe's series and records each step's :class:`~.messages.KVPipeStats` into them."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        unregister_kvpipe_metrics()
        operation = [*labelnames, "operation", "status"]
        stage = [*labelnames, "pipeline", "stage"]
        self._operation_seconds = self._histogram_cls(
            name=f"{PREFIX}store_operation_seconds",
            documentation="Time of kvpipe's store calls.",
            labelnames=operation,
            buckets=list(OPERATION_BUCKETS),
        )
        self._operation_counters = {
            field: self._counter_cls(
                name=f"{PREFIX}store_operation_{field}_total", documentation=doc, labelnames=operation
            )
            for field, doc in (
                ("keys", "Keys kvpipe's store calls asked about."),
                ("bytes", "Bytes kvpipe's store calls moved (put: stored, get: read)."),
                ("failed_keys", "Keys kvpipe's store calls failed."),
            )
        }
        self._counters = {
            name: self._counter_cls(name=f"{PREFIX}{name}_total", documentation=doc, labelnames=labelnames)
            for name, doc in {
                **COUNTERS,
                RECORDS_DROPPED: "Store calls not recorded because the log was full.",
            }.items()
        }
        self._labelled = {
            family: self._counter_cls(
                name=f"{PREFIX}{family}_total", documentation=doc, labelnames=[*labelnames, label]
            )
            for family, (label, doc) in LABELLED.items()
        }
        self._stage_dropped = self._counter_cls(
            name=f"{PREFIX}{STAGE_DROPPED}_total",
            documentation="Items a pipeline stage took out of the stream (entry: saves refused at a full queue).",
            labelnames=stage,
        )
        self._queue_depth = self._gauge_cls(
            name=f"{PREFIX}{QUEUE_DEPTH}",
            documentation="Items waiting in front of a pipeline stage (summed over ranks).",
            labelnames=stage,
            multiprocess_mode="mostrecent",
        )
        self._staging = {
            name: self._gauge_cls(
                name=f"{PREFIX}{name}",
                documentation=doc,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            for name, doc in (
                (STAGING_SLOTS_IN_USE, "Staging slots holding a save or a load (summed over ranks)."),
                (STAGING_SLOTS, "Staging slots (summed over ranks)."),
            )
        }
        self._breaker = self._gauge_cls(
            name=f"{PREFIX}{BREAKER_STATE}",
            documentation="The store circuit breaker, worst over ranks: 0 closed, 1 half-open, 2 open.",
            labelnames=[*labelnames, "role"],
            multiprocess_mode="mostrecent",
        )
        #: per engine, the latest gauge readings of each source (a role on a rank)
        self._readings: dict[int, dict[str, dict[str, float]]] = {}
        for engine in per_engine_labelvalues.values():  # at 0 from the start, not from the first event
            for counter in self._counters.values():
                counter.labels(*engine)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name == OPS:
                self._observe_operations(engine, value)
            elif name == GAUGES:
                self._readings.setdefault(engine_idx, {}).update(value)
                self._set_gauges(engine, self._readings[engine_idx])
            elif value:
                self._count(engine, name, value)

    def _observe_operations(self, engine: list[object], records: list[list[Any]]) -> None:
        for operation, status, seconds, keys, moved, failed in records:
            labels = [*engine, operation, status]
            self._operation_seconds.labels(*labels).observe(seconds)
            for field, amount in (("keys", keys), ("bytes", moved), ("failed_keys", failed)):
                if amount:
                    self._operation_counters[field].labels(*labels).inc(amount)

    def _count(self, engine: list[object], name: str, value: int) -> None:
        if (stage := split_per_stage(name)) is not None and stage[0] == STAGE_DROPPED:
            self._stage_dropped.labels(*engine, *stage[1:]).inc(value)
            return
        for family, counter in self._labelled.items():
            if name.startswith(f"{family}_"):
                counter.labels(*engine, name.removeprefix(f"{family}_")).inc(value)
                return
        counter = self._counters.get(name)
        if counter is None:  # a counter the table does not know yet: exported, not lost
            counter = self._counters[name] = self._counter_cls(
                name=f"{PREFIX}{name}_total",
                documentation=f"kvpipe counter {name}.",
                labelnames=self._labelnames,
            )
        counter.labels(*engine).inc(value)

    def _set_gauges(self, engine: list[object], readings: dict[str, dict[str, float]]) -> None:
        summed: dict[str, float] = {}
        worst: dict[str, float] = {}
        for source, gauges in readings.items():
            role = source.split(":", 1)[0]
            for name, value in gauges.items():
                if name == BREAKER_STATE:
                    worst[role] = max(worst.get(role, 0), value)
                else:
                    summed[name] = summed.get(name, 0) + value
        for name, value in summed.items():
            if (stage := split_per_stage(name)) is not None and stage[0] == QUEUE_DEPTH:
                self._queue_depth.labels(*engine, *stage[1:]).set(value)
            elif name in self._staging:
                self._staging[name].labels(*engine).set(value)
        for role, value in worst.items():
            self._breaker.labels(*engine, role).set(value)
