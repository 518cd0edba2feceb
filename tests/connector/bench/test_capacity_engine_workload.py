"""``kvpipe bench capacity-engine --quick``: real engines, a short skewed trace, one store size.

A smoke run's hit rates and times prove nothing about the policies, so this checks
what holds in any run: the record's shape, hit rates that are rates, offline bounds
in order, and that kvpipe's engine got something back from its store.
"""

from pathlib import Path
from typing import Any

import pytest

from kvpipe.connector.bench import BenchOptions, WorkloadResult, workload_runner
from kvpipe.connector.bench.capacity_engine import (
    BELADY,
    CONTENDERS,
    KVPIPE,
    SCENARIO,
    STATIC,
    prompt_ids,
    store_view,
)
from kvpipe.connector.bench.capacity_replay import BATCH
from kvpipe.connector.bench.vllm_prefix import BLOCK

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> WorkloadResult:
    return workload_runner("capacity-engine")(
        BenchOptions(quick=True, out_dir=tmp_path_factory.mktemp("bench"))
    )


def _rows(result: WorkloadResult) -> dict[str, dict[str, Any]]:
    return {row["contender"]: row for row in result.rows}


def test_every_contender_has_a_hit_rate(result: WorkloadResult) -> None:
    assert result.workload == "capacity-engine"
    rows = _rows(result)
    for name in CONTENDERS:
        assert 0 <= rows[name]["hit rate"] <= 1
        assert rows[name]["hit tokens"] <= rows[name]["cached tokens"]


def test_the_best_static_choice_is_not_above_belady(result: WorkloadResult) -> None:
    rows = _rows(result)
    assert 0 <= rows[STATIC]["hit rate"] <= rows[BELADY]["hit rate"] <= 1


def test_kvpipe_got_prompt_tokens_back_from_its_store(result: WorkloadResult) -> None:
    assert _rows(result)[KVPIPE]["hit tokens"] > 0


def test_targets_and_the_record(result: WorkloadResult, tmp_path: Path) -> None:
    names = [target.name for target in result.targets]
    assert any(name.startswith("kvpipe - vLLM's connector") for name in names)
    assert any(name.startswith("kvpipe / best static") for name in names)
    assert result.write(tmp_path).exists()


def test_the_store_sees_a_prefix_once_per_batch() -> None:
    trace = SCENARIO.trace(200)
    seen = store_view(trace)
    batches: dict[int, list[str]] = {}
    for request in seen.requests:
        batches.setdefault(request.index // BATCH, []).append(request.prefix)
    assert all(len(prefixes) == len(set(prefixes)) for prefixes in batches.values())
    # every prefix of every batch is still there
    assert {(r.index // BATCH, r.prefix) for r in trace.requests} == {
        (r.index // BATCH, r.prefix) for r in seen.requests
    }


def test_requests_of_a_prefix_share_its_tokens_and_nothing_else() -> None:
    trace = SCENARIO.trace(40)
    prompts = prompt_ids(trace)
    prefix_tokens = trace.prefix_chunks * BLOCK
    assert all(len(p) == (trace.prefix_chunks + trace.suffix_chunks) * BLOCK for p in prompts)
    by_prefix: dict[str, set[tuple[int, ...]]] = {}
    for request, prompt in zip(trace.requests, prompts, strict=True):
        by_prefix.setdefault(request.prefix, set()).add(tuple(prompt[:prefix_tokens]))
    assert all(len(heads) == 1 for heads in by_prefix.values())
    assert len({next(iter(heads)) for heads in by_prefix.values()}) == len(by_prefix)
    assert len({tuple(p[prefix_tokens:]) for p in prompts}) == len(prompts)
