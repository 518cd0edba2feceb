"""The store workloads of ``kvpipe bench`` run end to end (quick mode) against a real master.

Quick mode sizes make these smoke tests, not measurements: they check that every
contender stored what it was given and that the results are complete, not speed.
"""

import json
import os
from pathlib import Path

import pytest

from kvpipe.connector.bench import BenchOptions, workload_runner
from kvpipe.connector.bench.kvbench import UNSEALED, BenchCache, BenchError, PipelineContender
from kvpipe.connector.cli.main import main
from kvpipe.connector.store.memory import Faults, MemoryStore

pytestmark = pytest.mark.mooncake


@pytest.fixture
def options(tmp_path):
    return BenchOptions(quick=True, out_dir=tmp_path)


@pytest.mark.parametrize(
    ("workload", "contenders"),
    [
        ("local", {"raw", "pipeline", UNSEALED}),
        ("tcp", {"raw multi-buffer", "raw single-buffer", "pipeline", UNSEALED}),
        ("small-requests", {"sequential", "raw batched", "pipeline", UNSEALED}),
    ],
)
def test_a_store_workload_times_every_contender_and_states_its_targets(workload, contenders, options):
    result = workload_runner(workload)(options)
    assert {row["contender"] for row in result.rows} == contenders
    assert all(row["seconds"] > 0 and row["cores"] > 0 for row in result.rows)
    assert result.targets and all(target.measured > 0 for target in result.targets)
    assert [Path(plot).name for plot in result.plots] == [f"{workload}.png"]
    assert all(Path(plot).stat().st_size > 0 for plot in result.plots)


def test_the_framework_workload_reports_rate_and_submit_latency(options):
    result = workload_runner("framework")(options)
    [row] = result.rows
    assert row["async items/s"] > 0 and row["submit p99 us"] > 0
    assert row["anyio items/s"] > 0  # its baseline, measured in the same round
    assert abs(row["async / anyio"] - row["async items/s"] / row["anyio items/s"]) < 0.01
    assert {target.name for target in result.targets} == {"async items/s", "async / anyio", "submit p99 us"}


def test_a_pipeline_round_that_stores_nothing_is_an_error_not_a_time():
    cache = BenchCache.build(layers=2, buffer_bytes=1024, num_blocks=4)
    store = MemoryStore(faults=Faults(error_rates={"put": {-800: 1.0}}))
    with cache.registered(store), PipelineContender(cache, store) as contender:
        with pytest.raises(BenchError, match="failed 2 objects"):
            contender.round(cache.requests([2], salt="refused"))


def test_bench_writes_one_json_record_per_workload(tmp_path, capsys):
    assert main(["bench", "framework", "--quick", "--json", "--out", str(tmp_path)]) == 0
    [line] = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["workload"] == "framework"
    assert json.loads((tmp_path / "framework.json").read_text()) == record


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "nope"], "workload: unknown 'nope'"),
        (["bench", "--repeats", "0"], "--repeats: must be >= 1, got 0"),
    ],
)
def test_bad_bench_arguments_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvpipe: error: {message}")


def test_a_suite_of_several_workloads_runs_each_in_a_process_of_its_own(options, monkeypatch):
    from kvpipe.connector.bench import suite

    ran_here = []
    monkeypatch.setattr(suite, "workload_runner", lambda name: ran_here.append(name))
    with open(os.devnull, "w") as quiet:
        results = suite.run_suite(["framework", "local"], options, out=quiet)
    assert [result.workload for result in results] == ["local", "framework"]  # the suite's order
    assert ran_here == []  # both came back from child processes
    assert sorted(path.name for path in options.out_dir.glob("*.json")) == ["framework.json", "local.json"]
