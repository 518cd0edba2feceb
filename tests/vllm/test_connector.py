"""KVPipeConnector in a real (in-process) vLLM engine on a real mooncake master."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvpipe.connector.mooncake import MooncakeStore
from kvpipe.connector.vllm.launch import close_llm, kvpipe_transfer

from . import engine


@pytest.fixture(scope="module")
def llm(store_section: dict[str, Any], reference: dict[int, list[list[int]]]) -> Iterator[Any]:
    """One kvpipe engine for this module (group semantics on)."""
    extra = {"store": store_section, "enable_group_semantics": True, "staging_blocks": 64}
    transfer = {**kvpipe_transfer(extra), "kv_load_failure_policy": "recompute"}
    instance = engine.make_llm(transfer)
    yield instance
    close_llm(instance)


def worker_connector() -> Any:
    from kvpipe.connector.vllm import KVPipeConnector

    workers = [c for c in KVPipeConnector.instances if not c.is_scheduler and c._save_pipeline is not None]
    assert len(workers) == 1, workers
    return workers[0]


def scheduler_connector() -> Any:
    from kvpipe.connector.vllm import KVPipeConnector

    schedulers = [c for c in KVPipeConnector.instances if c.is_scheduler and c._store is not None]
    assert len(schedulers) == 1, schedulers
    return schedulers[0]


def test_second_pass_loads_the_stored_prefix(llm: Any, reference: dict[int, list[list[int]]]) -> None:
    batch = engine.prompts(1)
    first = engine.generate(llm, batch)
    assert first["cached"] == [0, 0]
    assert worker_connector().drain(10.0)
    objects = len(worker_connector().observed)
    assert objects == 2 * engine.FULL_HIT // engine.BLOCK
    assert llm.reset_prefix_cache()
    second = engine.generate(llm, batch)
    assert worker_connector().drain(10.0)
    assert len(worker_connector().observed) == objects  # what was loaded is not offered again
    print("pass 1", first["seconds"], "s; pass 2", second["seconds"], "s, cached", second["cached"])
    assert second["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert first["tokens"] == reference[1]
    assert second["tokens"] == reference[1]
    stats = worker_connector().stats
    assert stats["chunks_loaded"] >= 2 * engine.FULL_HIT // engine.BLOCK
    assert stats["saves_dropped_no_staging"] == 0


def test_loaded_kv_is_really_used(llm: Any, holder: MooncakeStore) -> None:
    """Overwrite the stored objects of a prompt with other bytes: the output changes."""
    import torch

    batch = engine.prompts(2)
    first = engine.generate(llm, batch)
    connector = worker_connector()
    assert connector.drain(10.0)
    records = [r for r, status in connector.observed if status.value == "put" and r.request_id]
    keys = sorted({r.key for r in records})
    per_batch = 2 * engine.FULL_HIT // engine.BLOCK
    assert len(keys) == 2 * per_batch  # this batch's and the previous test's
    mine = list(dict.fromkeys(r.key for r in records))[-per_batch:]  # this batch's: put last
    size = records[0].size
    noise = torch.randint(0, 255, (size,), dtype=torch.uint8)
    assert holder.register_buffer(noise.data_ptr(), size) == 0
    try:
        for key in mine:
            assert holder.remove(key, force=True) == 0
        ptrs, sizes = [noise.data_ptr()] * len(mine), [size] * len(mine)
        assert holder.batch_put_from(mine, ptrs, sizes, holder.new_replicate_config()) == [0] * len(mine)
    finally:
        holder.unregister_buffer(noise.data_ptr())
    assert llm.reset_prefix_cache()
    second = engine.generate(llm, batch)
    assert second["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert second["tokens"] != first["tokens"]


def test_group_semantics_tags_every_object_with_its_chunk(llm: Any) -> None:
    from kvpipe.stages import GROUP_ID_SCOPE

    records = [r for r, _ in worker_connector().observed]
    assert records
    for record in records:
        assert record.group_id == f"{GROUP_ID_SCOPE}:tiny-llama@{record.chunk_hash.hex()}"
        assert record.key == (f"tiny-llama@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{record.chunk_hash.hex()}")


def test_a_failed_load_is_recomputed(
    llm: Any, holder: MooncakeStore, reference: dict[int, list[list[int]]]
) -> None:
    """Objects of the wrong size: the lookup hits, the load fails, vLLM recomputes the blocks."""
    import torch

    batch = engine.prompts(7)
    engine.generate(llm, batch)
    connector = worker_connector()
    assert connector.drain(10.0)
    per_batch = 2 * engine.FULL_HIT // engine.BLOCK
    puts = [r for r, status in connector.observed if status.value == "put"]
    mine = list(dict.fromkeys(r.key for r in puts))[-per_batch:]
    half = puts[-1].size // 2
    noise = torch.zeros(half, dtype=torch.uint8)
    assert holder.register_buffer(noise.data_ptr(), half) == 0
    try:
        for key in mine:
            assert holder.remove(key, force=True) == 0
        ptrs, sizes = [noise.data_ptr()] * len(mine), [half] * len(mine)
        assert holder.batch_put_from(mine, ptrs, sizes, holder.new_replicate_config()) == [0] * len(mine)
    finally:
        holder.unregister_buffer(noise.data_ptr())
    failed_before = connector.stats["chunks_load_failed"]
    assert llm.reset_prefix_cache()
    again = engine.generate(llm, batch)
    assert connector.stats["chunks_load_failed"] - failed_before == per_batch
    assert again["tokens"] == reference[7]


def test_the_lookups_of_one_scheduling_step_are_one_store_call(llm: Any) -> None:
    """Four new requests admitted in one step: one ``batch_is_exist``, not one per request."""
    calls = scheduler_connector().stats["lookup_calls"]
    engine.generate(llm, engine.prompts(8, count=4))
    assert scheduler_connector().stats["lookup_calls"] - calls == 1
    assert worker_connector().drain(10.0)


def test_each_saved_object_is_one_buffer(llm: Any) -> None:
    """The worker stages blocks object-major: one buffer per object, not one per layer."""
    records = [record for record, _ in worker_connector().observed]
    assert records
    assert {len(record.buffers) for record in records} == {1}
    assert {record.size for record in records} == {2 * 64 * 1024}  # two layers' 64 KiB blocks
