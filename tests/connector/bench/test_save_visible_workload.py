"""The ``save-visible`` workload in quick mode: one busy engine at the default ``save_nice``.

Its timings prove nothing in a smoke run; what must hold in any run is the
result's shape, that the probe finds the keys the saves store (keys made by
other rules would never be seen), and that a chunk never seen is explained by a
save dropped for want of staging.
"""

from __future__ import annotations

import json

import pytest

from kvpipe.connector.bench import BenchOptions, WorkloadResult, workload_runner

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> WorkloadResult:
    return workload_runner("save-visible")(BenchOptions(quick=True, repeats=1, out_dir=tmp_path_factory.mktemp("b")))


def test_one_row_for_the_default_save_nice_with_every_column(result: WorkloadResult) -> None:
    assert [row["save_nice"] for row in result.rows] == [10]
    assert set(result.columns) <= set(result.rows[0])
    json.dumps(result.record())


def test_the_probe_finds_the_measured_requests_chunks_after_their_step(result: WorkloadResult) -> None:
    row = result.rows[0]
    assert row["chunks watched"] >= 4 * 8  # 4 measured requests of 8 full chunks each
    assert row["chunks never visible"] == 0 or row["saves dropped (no staging)"] > 0
    assert 0 < row["visible p50 ms"] <= row["visible p99 ms"] <= row["visible max ms"]
