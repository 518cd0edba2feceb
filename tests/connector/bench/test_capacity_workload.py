"""``kvpipe bench capacity --quick`` on a real spawned master: one capacity, every contender."""

from pathlib import Path

import pytest

from kvpipe.connector.bench import BenchOptions, WorkloadResult, workload_runner
from kvpipe.connector.bench.capacity import CONTENDERS


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
            assert row[f"{name} refused"] >= 0 and row[f"{name} evicted"] >= 0


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
        assert row["kvpipe + disk refused"] >= 0
    assert any(target.name.startswith("kvpipe + disk / unbounded") for target in result.targets)


def test_the_record_is_json(result: WorkloadResult, tmp_path: Path) -> None:
    assert result.write(tmp_path).exists()
