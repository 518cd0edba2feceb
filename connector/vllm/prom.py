"""kvpipe's Prometheus series in vLLM's ``/metrics``, built from :class:`~.messages.KVPipeStats`.

vLLM builds this once in its logger process (``build_prom_metrics``) and feeds
it every engine step's stats. The series are the catalogue's (:data:`~.metrics.CATALOGUE`:
names, kinds, labels and help come from there), each named ``kvpipe:...`` (vLLM's own
are ``vllm:...``, so none can clash) and carrying vLLM's labels (``model_name``,
``engine``) before its own. How each kind of stats arrives:

- counters, ``key -> growth``: added to the series the key names (:func:`~.metrics.metric_of`);
  a key the catalogue does not know is exported under its own name rather than lost;
- the store calls' records: the ``store_operation_*`` series, labelled by operation and status;
- a histogram's observations, ``key -> [value, ...]``: each observed into the series the key names;
- gauges, the latest reading of every role on every rank: summed over ranks, except
  the breaker's, which shows the worst rank of each role.
"""

from __future__ import annotations

from typing import Any, TypedDict, cast

from prometheus_client import Counter, Gauge, Histogram
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)

from .messages import GAUGES, OPS
from .metrics import (
    BREAKER_STATE,
    CATALOGUE,
    OPERATION_BYTES,
    OPERATION_FAILED_KEYS,
    OPERATION_KEYS,
    OPERATION_SECONDS,
    PREFIX,
    Keyed,
    Kind,
    Metric,
    metric_of,
)

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


class _Series(TypedDict):
    """What every kind of series is made with."""

    name: str
    documentation: str
    labelnames: list[str]


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
        # the class vLLM passes for each kind (prometheus_client's, or a wrapper), keyed by that
        # kind: vLLM's annotation cannot say a value is of its key's kind, so each is cast to it
        self._gauge = cast("type[Gauge]", metric_types[Gauge])
        self._counter = cast("type[Counter]", metric_types[Counter])
        self._histogram = cast("type[Histogram]", metric_types[Histogram])
        unregister_kvpipe_metrics()
        self._series = {metric.name: self._register(metric) for metric in CATALOGUE}
        #: counters a side reported that the catalogue does not know, by key
        self._unknown: dict[str, Counter] = {}
        #: per engine, the latest gauge readings of each source (a role on a rank)
        self._readings: dict[int, dict[str, dict[str, float]]] = {}
        for engine in per_engine_labelvalues.values():  # at 0 from the start, not from the first event
            for metric in CATALOGUE:
                if metric.kind is Kind.COUNTER and not metric.labels:
                    self._series[metric.name].labels(*engine)

    def _register(self, metric: Metric) -> Any:
        labelnames = [*self._labelnames, *(label.name for label in metric.labels)]
        series: _Series = {"name": metric.series, "documentation": metric.help, "labelnames": labelnames}
        if metric.kind is Kind.COUNTER:
            return self._counter(**series)
        if metric.kind is Kind.GAUGE:
            return self._gauge(**series, multiprocess_mode="mostrecent")
        return self._histogram(**series, buckets=list(OPERATION_BUCKETS))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name == OPS:
                self._observe_operations(engine, value)
            elif name == GAUGES:
                self._readings.setdefault(engine_idx, {}).update(value)
                self._set_gauges(engine, self._readings[engine_idx])
            elif isinstance(value, list):
                self._observe_samples(engine, name, value)
            elif value:
                self._count(engine, name, value)

    def _observe_operations(self, engine: list[object], records: list[list[Any]]) -> None:
        seconds_series = self._series[OPERATION_SECONDS]
        for operation, status, seconds, keys, moved, failed in records:
            labels = [*engine, operation, status]
            seconds_series.labels(*labels).observe(seconds)
            for name, amount in (
                (OPERATION_KEYS, keys),
                (OPERATION_BYTES, moved),
                (OPERATION_FAILED_KEYS, failed),
            ):
                if amount:
                    self._series[name].labels(*labels).inc(amount)

    def _observe_samples(self, engine: list[object], key: str, samples: list[float]) -> None:
        found = metric_of(key)
        if found is None or found[0].keyed is not Keyed.SAMPLES:
            return  # observations of no histogram the catalogue knows: nothing to put them in
        series = self._series[found[0].name].labels(*engine)
        for sample in samples:
            series.observe(sample)

    def _count(self, engine: list[object], key: str, value: int) -> None:
        found = metric_of(key)
        if found is not None:
            metric, label_values = found
            self._series[metric.name].labels(*engine, *label_values).inc(value)
            return
        counter = self._unknown.get(key)
        if counter is None:  # a counter the catalogue does not know yet: exported, not lost
            counter = self._unknown[key] = self._counter(
                name=f"{PREFIX}{key}_total",
                documentation=f"kvpipe counter {key}.",
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
            if (found := metric_of(name)) is not None:
                metric, label_values = found
                self._series[metric.name].labels(*engine, *label_values).set(value)
        for role, value in worst.items():
            self._series[BREAKER_STATE].labels(*engine, role).set(value)
