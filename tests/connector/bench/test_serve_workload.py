"""``kvpipe bench serve --quick``: two fleets (no connector, kvpipe) under vLLM's serving benchmark.

Figures are printed, never asserted (2 shared cores); what is asserted is what the
fleet must do whatever the machine's speed: no request fails, the outputs equal the
no-connector fleet's, and kvpipe's replicas load chunks the other replica stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.connector.bench import BenchOptions, WorkloadResult, workload_runner

pytestmark = [pytest.mark.mooncake, pytest.mark.engine]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> WorkloadResult:
    out_dir: Path = tmp_path_factory.mktemp("bench")
    measured = workload_runner("serve")(BenchOptions(quick=True, repeats=1, out_dir=out_dir))
    print("\n" + measured.table())
    return measured


def test_every_request_of_every_fleet_is_served(result: WorkloadResult) -> None:
    assert {(row["contender"], row["workload"]) for row in result.rows} == {
        (contender, workload) for contender in ("none", "kvpipe") for workload in ("prefix", "chat")
    }
    assert [row["failed"] for row in result.rows] == [0] * len(result.rows)


def test_kvpipes_fleet_answers_as_the_fleet_without_a_connector(result: WorkloadResult) -> None:
    assert [row["outputs = none's"] for row in result.rows if row["contender"] == "kvpipe"] == [True, True]


def test_kvpipes_replicas_load_what_the_other_replica_stored(result: WorkloadResult) -> None:
    kvpipe = [row for row in result.rows if row["contender"] == "kvpipe"]
    assert sum(row["connector hit tokens"] for row in kvpipe) > 0
    assert sum(row["chunks from the other replica"] for row in kvpipe) > 0
