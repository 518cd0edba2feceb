"""The ``vllm`` workload in quick mode: three real engines on the tiny model, store then reload.

Timings of a smoke run prove nothing, so this checks what must hold in any run:
the result's shape, that kvpipe's second pass is served by the store, and that
every contender's greedy outputs equal the no-connector engine's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpipe.connector.bench import BenchOptions, WorkloadResult, workload_runner
from kvpipe.connector.bench.hook_clock import HookReport
from kvpipe.connector.bench.vllm_prefix import CONTENDERS, KVPIPE, NONE, STEP_HOOK, TIMED

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> WorkloadResult:
    out_dir = tmp_path_factory.mktemp("bench")
    return workload_runner("vllm")(BenchOptions(quick=True, repeats=1, out_dir=out_dir))


def test_one_row_per_contender_with_every_column(result: WorkloadResult) -> None:
    assert result.workload == "vllm"
    assert [row["contender"] for row in result.rows] == list(CONTENDERS)
    for row in result.rows:
        assert set(result.columns) <= set(row)
        assert row["pass1_s"] > 0 and row["pass2_s"] > 0
    json.dumps(result.record())  # the suite writes it as JSON


def test_kvpipe_serves_the_second_pass_from_the_store(result: WorkloadResult) -> None:
    rows = {row["contender"]: row for row in result.rows}
    assert rows[NONE]["hit_tokens"] == rows[NONE]["connector_hits"] == 0
    assert rows[KVPIPE]["connector_hits"] > 0
    assert rows[KVPIPE]["hit_tokens"] > 0
    assert rows[KVPIPE]["cached_tokens"] > rows[NONE]["cached_tokens"]


def test_outputs_match_the_engine_without_a_connector(result: WorkloadResult) -> None:
    assert all(row["same_outputs"] for row in result.rows)


def test_targets_name_the_model_and_a_plot_is_written(result: WorkloadResult) -> None:
    assert result.targets and all(target.name.startswith("tiny: ") for target in result.targets)
    assert result.plots and all(Path(plot).stat().st_size > 0 for plot in result.plots)


def test_kvpipe_engines_report_the_cpu_their_hooks_took_per_step(result: WorkloadResult) -> None:
    hook_times = result.parameters["hook_times"]["tiny"]
    for name in TIMED:
        report = HookReport.from_dict(hook_times[name])
        assert report.hooks[STEP_HOOK].calls > 0
        assert 0 < report.cpu_s < report.thread_cpu_s
        assert any(note.startswith(f"tiny {name}: engine thread in kvpipe hooks: ") for note in result.notes)
