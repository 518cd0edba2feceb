"""``kvpipe bench fragmentation --quick`` on a real spawned master: one capacity, semantics on and off."""

from pathlib import Path

import pytest

from kvpipe.connector.bench import BenchOptions, WorkloadResult, workload_runner


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> WorkloadResult:
    out_dir = tmp_path_factory.mktemp("bench")
    return workload_runner("fragmentation")(BenchOptions(quick=True, out_dir=out_dir))


def test_every_row_has_every_column_and_both_semantics(result: WorkloadResult) -> None:
    assert result.workload == "fragmentation"
    assert result.rows
    assert all(set(row) == set(result.columns) for row in result.rows)
    semantics = [row["group semantics"] for row in result.rows]
    assert semantics.count("off") == semantics.count("on") >= 1
    for row in result.rows:
        assert row["complete"] + row["partial"] + row["absent"] == result.parameters["chunks"]
        assert 0 <= row["partial MiB"] <= row["live MiB"]


def test_the_store_was_too_small_for_the_workload(result: WorkloadResult) -> None:
    assert all(row["capacity/workload"] < 1 and row["absent"] > 0 for row in result.rows)


def test_group_semantics_leave_no_partial_chunk(result: WorkloadResult) -> None:
    grouped = [row for row in result.rows if row["group semantics"] == "on"]
    assert grouped
    assert all(row["partial"] == 0 and row["partial MiB"] == 0 for row in grouped)
    assert [target.name for target in result.targets] == ["partial/live with group ids (max)"]
    assert result.all_met


def test_the_plot_is_written_and_the_record_is_json(result: WorkloadResult, tmp_path: Path) -> None:
    assert [Path(plot).suffix for plot in result.plots] == [".png"]
    assert Path(result.plots[0]).stat().st_size > 0
    assert result.write(tmp_path).exists()
