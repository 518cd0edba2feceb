"""The ``vllm-loads`` workload in quick mode: one round per load mode on the 8-layer model.

Its timings prove nothing in a smoke run; what must hold in any run is the
result's shape and the count the connector controls: one load per shared prefix.
"""

from __future__ import annotations

import json

import pytest

from kvpipe.connector.bench import BenchOptions, WorkloadResult, workload_runner

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> WorkloadResult:
    return workload_runner("vllm-loads")(
        BenchOptions(quick=True, repeats=1, out_dir=tmp_path_factory.mktemp("b"))
    )


def test_one_row_per_load_mode_with_every_column(result: WorkloadResult) -> None:
    assert [row["loads"] for row in result.rows] == ["sync", "async", "async, load_nice 10"]
    for row in result.rows:
        assert set(result.columns) <= set(row)
        assert row["decode p50 ms (loading)"] > 0 and row["TTFT p50 ms"] > 0
    json.dumps(result.record())


def test_requests_sharing_a_stored_prefix_load_it_once_in_either_mode(result: WorkloadResult) -> None:
    assert [row["loads per shared prefix"] for row in result.rows] == [1, 1, 1]
