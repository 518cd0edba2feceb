"""The ``vllm-layerwise`` workload in quick mode: every engine at 1k tokens on the 8-layer model.

Its timings prove nothing in a smoke run; what must hold in any run is the
result's shape, every reload served whole from the store, and a timeline with
every layer's bytes in before its attention.
"""

from __future__ import annotations

import json

import pytest

from kvpipe.connector.bench import BenchOptions, WorkloadResult, workload_runner
from kvpipe.connector.bench.layerwise import ENGINES, LENGTHS

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> WorkloadResult:
    return workload_runner("vllm-layerwise")(
        BenchOptions(quick=True, repeats=1, out_dir=tmp_path_factory.mktemp("b"))
    )


def test_one_row_per_engine_with_every_column(result: WorkloadResult) -> None:
    assert [row["engine"] for row in result.rows] == list(ENGINES)
    for row in result.rows:
        assert set(result.columns) <= set(row)
        assert row["reload TTFT p50 ms"] > 0
    json.dumps(result.record())


def test_every_reload_loads_every_whole_block_of_the_prompt(result: WorkloadResult) -> None:
    assert {row["reloaded tokens"] for row in result.rows} == {LENGTHS[0]}


def test_the_timelines_have_every_layers_bytes_in_before_its_attention(result: WorkloadResult) -> None:
    rows = [note for note in result.notes if note.startswith("| model.layers.")]
    assert len(rows) == 2 * 8  # both layer-wise engines, eight layers each
    for row in rows:
        _, _, reached, landed, attention, _, _ = row.split("|")
        assert float(landed) <= float(attention)
