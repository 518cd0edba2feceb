"""kvpipe's Prometheus series: what each step's stats become, and that a real engine's agree with its counters."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from kvpipe.connector.engines.launch import close_llm, kvpipe_transfer
from kvpipe.connector.vllm.messages import GAUGES, OPS, KVPipeStats
from kvpipe.connector.vllm.metrics import CATALOGUE
from kvpipe.connector.vllm.prom import KVPipePromMetrics

from . import engine

ENGINE = {"model_name": "tiny", "engine": "0"}


def prom() -> KVPipePromMetrics:
    """A fresh set of series (an earlier test's are unregistered, as a new engine's would be)."""
    return KVPipePromMetrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
        list(ENGINE),
        {0: list(ENGINE.values())},
    )


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {**ENGINE, **labels})


def test_every_catalogue_entry_is_a_series_of_its_kind_with_its_help() -> None:
    prom()
    families = {family.name: family for family in REGISTRY.collect() if family.name.startswith("kvpipe:")}
    exposed = {name: (family.type, family.documentation) for name, family in families.items()}
    # prometheus_client names a counter's family without the _total its samples carry
    expected = {m.series.removesuffix("_total"): (m.kind.value, m.help) for m in CATALOGUE}
    assert exposed == expected


def test_counters_become_total_series_and_add_up_over_steps() -> None:
    metrics = prom()
    metrics.observe({"saves_submitted": 2, "lookup_hit_tokens": 256})
    metrics.observe({"saves_submitted": 3})
    assert value("kvpipe:saves_submitted_total") == 5
    assert value("kvpipe:lookup_hit_tokens_total") == 256


def test_object_and_job_counters_are_labelled_by_status_and_outcome() -> None:
    metrics = prom()
    metrics.observe({"objects_put": 4, "objects_existing": 2, "save_jobs_partial": 1})
    assert value("kvpipe:objects_total", status="put") == 4
    assert value("kvpipe:objects_total", status="existing") == 2
    assert value("kvpipe:save_jobs_total", outcome="partial") == 1


def test_stage_drops_are_labelled_by_pipeline_and_stage() -> None:
    metrics = prom()
    metrics.observe({"stage_dropped/save/entry": 3, "stage_dropped/save/filter": 1})
    assert value("kvpipe:stage_dropped_total", pipeline="save", stage="entry") == 3
    assert value("kvpipe:stage_dropped_total", pipeline="save", stage="filter") == 1


def test_an_unknown_counter_is_exported_rather_than_lost() -> None:
    metrics = prom()
    metrics.observe({"something_new": 7})
    assert value("kvpipe:something_new_total") == 7


def test_store_calls_fill_the_histogram_and_the_key_byte_and_failure_counters() -> None:
    metrics = prom()
    metrics.observe({OPS: [("put", "ok", 0.002, 4, 4096, 0), ("put", "error", 0.5, 2, 1024, 1)]})
    assert value("kvpipe:store_operation_seconds_count", operation="put", status="ok") == 1
    assert value("kvpipe:store_operation_seconds_bucket", operation="put", status="ok", le="0.0025") == 1
    assert value("kvpipe:store_operation_seconds_bucket", operation="put", status="error", le="0.25") == 0
    assert value("kvpipe:store_operation_keys_total", operation="put", status="ok") == 4
    assert value("kvpipe:store_operation_bytes_total", operation="put", status="error") == 1024
    assert value("kvpipe:store_operation_failed_keys_total", operation="put", status="error") == 1


def test_gauges_sum_the_latest_reading_of_every_rank() -> None:
    metrics = prom()
    metrics.observe({GAUGES: {"worker:0:0": {"staging_slots": 256, "staging_slots_in_use": 10}}})
    metrics.observe({GAUGES: {"worker:1:0": {"staging_slots": 256, "staging_slots_in_use": 5}}})
    metrics.observe({GAUGES: {"worker:0:0": {"staging_slots": 256, "staging_slots_in_use": 1}}})
    assert value("kvpipe:staging_slots") == 512
    assert value("kvpipe:staging_slots_in_use") == 6  # rank 0's second reading replaced its first


def test_queue_depth_is_a_gauge_per_pipeline_and_stage() -> None:
    metrics = prom()
    metrics.observe(
        {GAUGES: {"worker:0:0": {"stage_queue_depth/save/put": 3, "stage_queue_depth/load/get": 0}}}
    )
    assert value("kvpipe:stage_queue_depth", pipeline="save", stage="put") == 3
    assert value("kvpipe:stage_queue_depth", pipeline="load", stage="get") == 0


def test_the_breaker_gauge_shows_the_worst_rank_of_each_role() -> None:
    metrics = prom()
    metrics.observe(
        {
            GAUGES: {
                "worker:0:0": {"breaker_state": 0},
                "worker:1:0": {"breaker_state": 2},
                "scheduler": {"breaker_state": 1},
            }
        }
    )
    assert value("kvpipe:breaker_state", role="worker") == 2
    assert value("kvpipe:breaker_state", role="scheduler") == 1


def test_landing_times_fill_the_landing_histogram() -> None:
    metrics = prom()
    metrics.observe({"save_landing_seconds": [0.05, 0.3]})
    metrics.observe({"save_landing_seconds": [2.0]})
    assert value("kvpipe:save_landing_seconds_count") == 3
    assert value("kvpipe:save_landing_seconds_sum") == pytest.approx(2.35)
    assert value("kvpipe:save_landing_seconds_bucket", le="1.0") == 2


def test_stats_aggregate_observations_by_concatenating_them() -> None:
    stats = KVPipeStats(data={"save_landing_seconds": [0.1]})
    stats.aggregate(KVPipeStats(data={"save_landing_seconds": [0.3, 0.2]}))
    assert stats.data["save_landing_seconds"] == [0.1, 0.3, 0.2]
    assert stats.reduce() == {"save_landing_seconds_count": 3, "save_landing_seconds_mean": 0.2}


def test_stats_aggregate_counters_records_and_readings_each_their_way() -> None:
    stats = KVPipeStats(
        data={"loads": 1, OPS: [("get", "ok", 0.1, 1, 64, 0)], GAUGES: {"worker:0:0": {"a": 1}}}
    )
    stats.aggregate(
        KVPipeStats(data={"loads": 2, OPS: [("get", "ok", 0.3, 1, 64, 0)], GAUGES: {"worker:1:0": {"a": 2}}})
    )
    assert stats.data["loads"] == 3
    assert len(stats.data[OPS]) == 2
    assert stats.data[GAUGES] == {"worker:0:0": {"a": 1}, "worker:1:0": {"a": 2}}
    assert stats.reduce() == {"loads": 3, "get_calls": 2, "get_avg_ms": 200.0, "get_failed_keys": 0}


@pytest.fixture(scope="module")
def engine_run(store_section: dict[str, Any]) -> dict[str, Any]:
    """A real engine stores prompts 51 and hits them after a prefix-cache reset; its counters and series."""
    llm = engine.make_llm(kvpipe_transfer({"store": store_section}))
    try:
        live = engine.launch.connectors(llm)
        first = engine.generate(llm, engine.prompts(51))
        assert all(c.drain() for c in live if c.worker is not None)
        llm.reset_prefix_cache()
        second = engine.generate(llm, engine.prompts(51))
        engine.generate(llm, [[1, 2, 3]])  # one more step: the last counts reach the logger
        counters = {
            role: dict(getattr(connector, role).stats)
            for connector in live
            for role in ("scheduler", "worker")
            if getattr(connector, role) is not None
        }
        series = {
            (
                sample.name,
                tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ENGINE)),
            ): sample.value
            for family in REGISTRY.collect()
            if family.name.startswith("kvpipe:")
            for sample in family.samples
        }
    finally:
        close_llm(llm)
    return {"first": first, "second": second, "counters": counters, "series": series}


def test_an_engine_s_series_agree_with_its_connector_s_counters(engine_run: dict[str, Any]) -> None:
    counters, series = engine_run["counters"], engine_run["series"]
    assert engine_run["second"]["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert series[("kvpipe:objects_total", (("status", "put"),))] == counters["worker"]["objects_put"] > 0
    assert series[("kvpipe:lookup_hit_tokens_total", ())] == counters["scheduler"]["lookup_hit_tokens"]
    assert counters["scheduler"]["lookup_hit_tokens"] == 2 * engine.FULL_HIT
    assert series[("kvpipe:chunks_loaded_total", ())] == counters["worker"]["chunks_loaded"]
    assert series[("kvpipe:chunks_verified_total", ())] == counters["worker"]["chunks_loaded"]


def test_an_engine_s_saves_landed_are_in_the_landing_histogram(engine_run: dict[str, Any]) -> None:
    counters, series = engine_run["counters"], engine_run["series"]
    assert series[("kvpipe:save_landing_seconds_count", ())] == counters["worker"]["save_jobs_ok"] > 0
    assert series[("kvpipe:save_landing_seconds_sum", ())] > 0


def test_an_engine_s_store_calls_are_in_the_operation_series(engine_run: dict[str, Any]) -> None:
    counters, series = engine_run["counters"], engine_run["series"]
    put_keys = series[("kvpipe:store_operation_keys_total", (("operation", "put"), ("status", "ok")))]
    got = series[("kvpipe:store_operation_keys_total", (("operation", "get"), ("status", "ok")))]
    seals_put = put_keys - counters["worker"]["objects_put"]
    assert seals_put > 0
    assert got - counters["worker"]["chunks_loaded"] == seals_put  # each seal read once
    assert series[("kvpipe:store_operation_seconds_count", (("operation", "exist"), ("status", "ok")))] >= 2
