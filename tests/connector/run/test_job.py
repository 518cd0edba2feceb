"""``kvpipe run``'s job: a synthetic workload saved, read back and counted."""

from collections import Counter

import pytest

from kvpipe.connector.run.baselines import ALONE_PREFIX, RAW_PREFIX, ROUNDS
from kvpipe.connector.run.config import RunConfig
from kvpipe.connector.run.job import run
from kvpipe.connector.store.memory import Faults, MemoryStore
from kvpipe.stages import ObjectStatus
from kvpipe.stages.keys import SEAL_SUFFIX

SMALL = {
    "model": {"layers": 2, "kv_heads": 2, "head_size": 32, "num_blocks": 512},
    "workload": {
        "requests": 40,
        "system_prompt_tokens": [32, 128],
        "user_tokens": [8, 48],
        "output_tokens": [8, 24],
    },
}

HYBRID = {
    "store": {"kind": "memory", "capacity": "1MB", "lease_ttl_s": 0.01},
    "model": {
        "name": "hybrid",
        "layers": 2,
        "kv_heads": 2,
        "head_size": 32,
        "block_size": 32,
        "hash_block_size": 16,
        "num_blocks": 512,
        "groups": [
            {"kind": "full_attention"},
            {"kind": "ring_buffer"},
            {"kind": "mamba", "mamba_mode": "align"},
        ],
    },
    "parallel": {"tp_size": 2},
    "workload": SMALL["workload"] | {"requests": 80},
    "save": {"enable_group_semantics": True, "cache_prefix": "tenant"},
}


def _config(document: dict, **sections: dict) -> RunConfig:
    return RunConfig.model_validate(document | sections)


def test_every_object_read_back_matches_what_was_saved():
    report = run(_config(SMALL)).report

    assert report["verify"]["mismatches"] == 0
    assert report["verify"]["missing"] == 0
    assert report["verify"]["checked"] == report["objects"]["distinct_keys"] > 0


def test_every_considered_object_is_existing_put_or_failed():
    objects = run(_config(SMALL)).report["objects"]

    assert objects["considered"] == objects["existing"] + objects["put"] + objects["failed"]
    assert objects["failed"] == 0


def test_the_report_has_the_contract_fields():
    report = run(_config(SMALL)).report

    assert report["store"].keys() >= {"kind", "group_ids_supported", "group_semantics"}
    assert report["objects"].keys() >= {"considered", "existing", "put", "failed", "unsealed"}
    assert report["chunks"].keys() >= {"total", "complete", "partial", "absent"}
    assert report["verify"].keys() >= {"checked", "mismatches", "missing"}
    assert report.keys() >= {"requests", "bytes_put", "elapsed_s", "put_gbps", "stages"}
    assert set(report["stages"]) == {"project", "full", "tail", "group_ids", "filter", "gather", "put"}
    assert report["stages"]["put"].keys() >= {"in", "out", "dropped", "errors", "p50_ms", "p99_ms"}


def test_the_report_times_the_pipeline_alone_and_raw_puts_of_the_same_objects():
    result = run(_config(SMALL), baselines=True)
    report = result.report

    assert 0 < report["synthetic_kv_s"] < report["elapsed_s"]
    stored = sum(
        record.size for record, status in result.objects.values() if status is not ObjectStatus.FAILED
    )
    assert report["pipeline_alone"]["bytes"] == stored and report["pipeline_alone"]["failed"] == 0
    assert report["raw_put"]["bytes"] == stored and report["raw_put"]["failed"] == 0
    # the rates are reported to 3 places (half a unit either way), the ratio from the exact ones
    alone, raw, half = report["pipeline_alone"]["gbps"], report["raw_put"]["gbps"], 0.0005
    low, high = (alone - half) / (raw + half), (alone + half) / (raw - half)
    assert low - half <= report["pipeline_vs_raw_put"] <= high + half


def test_the_pipelines_rate_leaves_out_the_generators_time():
    report = run(_config(SMALL)).report

    assert report["synthetic_kv_bytes"] >= report["bytes_put"] > 0  # every block offered is written
    pipeline_s = report["bytes_put"] / report["pipeline_gbps"] / 1e9
    assert pipeline_s == pytest.approx(report["elapsed_s"] - report["synthetic_kv_s"], rel=0.01, abs=0.002)


def test_without_baselines_the_report_says_only_the_synthetic_kv_time():
    report = run(_config(SMALL)).report

    assert report["synthetic_kv_s"] > 0
    assert (
        report["pipeline_alone"] is None
        and report["raw_put"] is None
        and report["pipeline_vs_raw_put"] is None
    )


def test_the_measurements_after_the_run_leave_the_store_as_the_run_left_it():
    store = MemoryStore()
    run(_config(SMALL), store=store, baselines=True)
    assert store.remove_by_regex(f"^{RAW_PREFIX}@", True) == 0  # no raw copy left
    assert store.remove_by_regex(f"^{ALONE_PREFIX}@", True) == 0  # nor the pipeline-alone replay's
    assert run(_config(SMALL), store=store).report["objects"]["put"] == 0  # none of the run's went


class _PutLog(MemoryStore):
    """A memory store that logs, per put call, its keys, and how many objects it held before."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: list[tuple[list[str], int]] = []

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes, config):
        self.puts.append((list(keys), self.stats().objects))
        return super().batch_put_from_multi_buffers(keys, ptrs, sizes, config)


def test_the_baselines_each_store_the_runs_objects_under_keys_of_their_own_and_keep_them():
    store = _PutLog()
    result = run(_config(SMALL), store=store, baselines=True)

    run_keys = {key for key, (_, status) in result.objects.items() if status is not ObjectStatus.FAILED}
    assert run_keys  # the run stored objects: the baselines have something to copy
    raw_keys = Counter(key for keys, _ in store.puts for key in keys if key.startswith(f"{RAW_PREFIX}@"))
    # each object once a round: the untimed first round and the timed ones
    assert raw_keys == {f"{RAW_PREFIX}@{key}": ROUNDS + 1 for key in run_keys}
    alone_keys = {key for keys, _ in store.puts for key in keys if key.startswith(f"{ALONE_PREFIX}@")}
    alone_objects = {key for key in alone_keys if not key.endswith(SEAL_SUFFIX)}
    assert alone_objects == {f"{ALONE_PREFIX}@{key}" for key in run_keys}


def test_each_baseline_round_writes_while_the_others_copy_stays_and_its_own_is_gone():
    store = _PutLog()
    run(_config(SMALL), store=store, baselines=True)

    def measurement(keys: list[str]) -> str:
        return keys[0].split("@")[0]

    # (measurement, objects held when its round began), one per round, in order
    rounds = [
        (measurement(keys), held)
        for index, (keys, held) in enumerate(store.puts)
        if measurement(keys) in (ALONE_PREFIX, RAW_PREFIX)
        and (index == 0 or measurement(store.puts[index - 1][0]) != measurement(keys))
    ]
    assert [name for name, _ in rounds] == [ALONE_PREFIX, RAW_PREFIX] * (ROUNDS + 1)
    run_left = rounds[0][1]  # the run's objects (and seals), before any measurement
    alone_copy = rounds[1][1] - run_left  # its objects and seals, there when the raw puts began
    raw_copy = rounds[2][1] - run_left  # the raw puts' objects, there when the alone's second round began
    assert alone_copy > 0 and raw_copy > 0
    assert all(held == run_left + alone_copy for name, held in rounds[1::2])
    assert all(held == run_left + raw_copy for name, held in rounds[2::2])


def test_a_second_run_on_the_kept_store_finds_every_object_and_puts_none():
    store = MemoryStore()
    first = run(_config(SMALL), store=store).report
    second = run(_config(SMALL), store=store).report

    assert first["objects"]["put"] > 0
    assert second["objects"]["put"] == 0
    assert second["objects"]["existing"] == second["objects"]["considered"] == first["objects"]["considered"]


def test_shared_prefixes_are_stored_once():
    report = run(_config(SMALL)).report

    assert report["objects"]["existing"] > 0
    assert report["chunks"]["total"] == report["objects"]["distinct_keys"]  # one group, one rank


def test_the_hybrid_model_never_stores_the_ring_buffer_and_numbers_mamba_1():
    result = run(_config(HYBRID))
    groups = {key.split("@group:")[1].split("@")[0] for key in result.objects}

    assert groups == {"0", "1"}
    assert all(key.startswith("tenant@hybrid@tp_rank:") for key in result.objects)


def test_with_group_semantics_eviction_leaves_no_partial_chunk():
    store = MemoryStore(1 << 20, lease_ttl_s=0.01)
    report = run(_config(HYBRID), store=store).report

    assert store.stats().evicted_objects > 0
    assert report["chunks"]["absent"] > 0
    assert report["chunks"]["partial"] == 0
    assert report["verify"]["mismatches"] == 0


def test_every_object_of_a_chunk_carries_that_chunks_group_id():
    result = run(_config(HYBRID))

    assert result.objects
    for key, (record, _) in result.objects.items():
        assert record.group_id == f"vllm-mooncake-store:tenant@hybrid@{key.rsplit('@', 1)[1]}"


def test_finished_requests_save_their_partial_tail_when_hashes_are_finer_than_blocks():
    report = run(_config(HYBRID)).report

    assert report["stages"]["tail"]["in"] > 0


def test_blocks_are_not_reused_while_their_save_is_in_flight():
    """A slow store and a tight block pool: reuse before the put would store wrong bytes."""
    store = MemoryStore(faults=Faults(latency_s={"put": 0.003}))
    tight = SMALL | {"model": SMALL["model"] | {"num_blocks": 96}}

    report = run(_config(tight), store=store).report

    assert report["verify"]["mismatches"] == 0
    assert report["verify"]["checked"] > 0


def test_a_store_without_group_ids_saves_without_them():
    store = MemoryStore(group_ids_supported=False)
    result = run(_config(HYBRID), store=store)

    assert result.report["store"] == {
        "kind": "memory",
        "group_ids_supported": False,
        "group_semantics": False,
    }
    assert result.objects and all(record.group_id is None for record, _ in result.objects.values())
