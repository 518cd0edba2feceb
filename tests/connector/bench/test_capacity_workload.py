"""``kvpipe bench capacity --quick`` on a real spawned master: one capacity, every contender."""

from pathlib import Path

import pytest

from kvpipe.connector.bench import BenchOptions, WorkloadResult, workload_runner
from kvpipe.connector.bench.capacity import CONTENDERS, PREFIX_CHUNKS, PREFIXES, SCENARIOS
from kvpipe.connector.bench.kvbench import MiB

#: the requests of the quick run's trace (capacity.run: ``scenario.trace(120)`` of its last scenario)
QUICK_REQUESTS = 120


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> WorkloadResult:
    return workload_runner("capacity")(BenchOptions(quick=True, out_dir=tmp_path_factory.mktemp("bench")))


def test_every_row_has_a_hit_rate_refusals_and_evictions_for_every_contender(result: WorkloadResult) -> None:
    assert result.workload == "capacity"
    assert result.rows
    for row in result.rows:
        assert set(row) == set(result.columns)
        for name in CONTENDERS:
            assert 0 <= row[name] <= 1
            assert isinstance(row[f"{name} refused"], int) and isinstance(row[f"{name} evicted"], int)


def test_vllms_connector_lost_every_chunk_it_offered_but_what_the_store_holds(result: WorkloadResult) -> None:
    """vLLM's connector offers each distinct chunk of the trace the first time it is seen (nothing
    holds it yet), and removes none; the store holds a capacity's worth of objects at most. So all
    but that many were evicted or refused: a count the trace and the capacity determine."""
    trace = SCENARIOS[-1].trace(QUICK_REQUESTS)
    prefixes = len({request.prefix for request in trace.requests})
    distinct = prefixes * trace.prefix_chunks + len(trace.requests) * trace.suffix_chunks
    working_set_mib = result.parameters["working_set_mib"]
    object_bytes = working_set_mib * MiB // (PREFIXES * PREFIX_CHUNKS)
    for row in result.rows:
        assert row["scenario"] == SCENARIOS[-1].name
        holds = round(row["capacity"] * working_set_mib) * MiB // object_bytes
        lost = row["vLLM's connector evicted"] + row["vLLM's connector refused"]
        assert lost >= distinct - holds > 0, (lost, distinct, holds)


def test_the_offline_optimum_is_never_below_the_best_static_choice(result: WorkloadResult) -> None:
    assert all(row["Belady"] >= row["best static"] > 0 for row in result.rows)


def test_a_store_smaller_than_the_working_set_evicted_and_still_hit(result: WorkloadResult) -> None:
    for row in result.rows:
        assert row["capacity"] < 1
        assert row["kvpipe evicted"] > 0
        assert row["kvpipe"] > 0


def test_targets_compare_kvpipe_with_the_best_static_choice_and_vllms_connector(
    result: WorkloadResult,
) -> None:
    names = [target.name for target in result.targets]
    assert any(name.startswith("kvpipe / best static") for name in names)
    assert any(name.startswith("kvpipe - vLLM's connector") for name in names)


def test_the_disk_tier_run_hits_at_most_what_an_unbounded_store_would(result: WorkloadResult) -> None:
    disk_rows = [row for row in result.rows if "kvpipe + disk" in row]
    assert disk_rows
    for row in disk_rows:
        assert 0 < row["kvpipe + disk"] <= row["unbounded"] <= 1
        assert isinstance(row["kvpipe + disk refused"], int)
    assert any(target.name.startswith("kvpipe + disk / unbounded") for target in result.targets)


def test_the_record_is_json(result: WorkloadResult, tmp_path: Path) -> None:
    assert result.write(tmp_path).exists()
