"""``kvpipe bench serve --pd --quick``: a prefill/decode split under vLLM's serving benchmark, beside no connector.

Figures are printed, never asserted (2 shared cores); what is asserted is what the
split must do whatever the machine's speed: no request fails, the outputs equal the
fleet without a connector's, and the decode engine takes the prompts from the store.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.connector.bench import BenchOptions, WorkloadResult, workload_runner

pytestmark = [pytest.mark.mooncake, pytest.mark.engine]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> WorkloadResult:
    out_dir: Path = tmp_path_factory.mktemp("bench")
    measured = workload_runner("serve-pd")(BenchOptions(quick=True, repeats=1, out_dir=out_dir))
    print("\n" + measured.table())
    return measured


def test_every_request_of_every_arrangement_is_served(result: WorkloadResult) -> None:
    assert {(row["arrangement"], row["workload"]) for row in result.rows} == {
        (arrangement, workload) for arrangement in ("none", "kvpipe PD") for workload in ("prefix", "chat")
    }
    assert [row["failed"] for row in result.rows] == [0] * len(result.rows)


def test_the_split_answers_as_the_fleet_without_a_connector(result: WorkloadResult) -> None:
    split = [row for row in result.rows if row["arrangement"] == "kvpipe PD"]
    assert [row["outputs = none's"] for row in split] == [True, True]


def test_the_decode_engine_loads_the_prompts_from_the_store(result: WorkloadResult) -> None:
    split = [row for row in result.rows if row["arrangement"] == "kvpipe PD"]
    assert all(row["decode: loaded tokens"] > 0 for row in split)
