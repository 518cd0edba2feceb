"""KVPipeConnector in a real (in-process) vLLM engine on a real mooncake master.

Every test stands alone, in any order or subset: each generates its own prompts
(a seed of its own) and counts only what its own passes stored, loaded or saw.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpipe.connector.engines.launch import close_llm, greedy, kvpipe_transfer
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.stages import seal_key

from ...stages.openmp import openmp_workers
from . import engine

PER_BATCH = 2 * engine.FULL_HIT // engine.BLOCK  # objects of one batch of two prompts


@pytest.fixture(scope="module")
def llm(store_section: dict[str, Any], reference: dict[int, list[list[int]]]) -> Iterator[Any]:
    """One kvpipe engine for this module (group semantics on, async loads: the defaults)."""
    extra = {"store": store_section, "enable_group_semantics": True, "staging_blocks": 64}
    transfer = kvpipe_transfer(extra, load_failure_policy="recompute")
    instance = engine.make_llm(transfer)
    yield instance
    close_llm(instance)


def test_second_pass_loads_the_stored_prefix(llm: Any, reference: dict[int, list[list[int]]]) -> None:
    batch = engine.prompts(1)
    first, records = engine.stored_by(llm, batch)
    assert first["cached"] == [0, 0]
    assert len({r.key for r in records}) == PER_BATCH
    loaded_before = engine.worker(llm).stats["chunks_loaded"]
    assert llm.reset_prefix_cache()
    second, again = engine.stored_by(llm, batch)
    assert again == []  # what was loaded is not offered again
    print("pass 1", first["seconds"], "s; pass 2", second["seconds"], "s, cached", second["cached"])
    assert second["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert first["tokens"] == second["tokens"] == reference[1]
    assert engine.worker(llm).stats["chunks_loaded"] - loaded_before == PER_BATCH
    assert engine.worker(llm).stats["saves_dropped_no_staging"] == 0


def test_loaded_kv_is_really_used(llm: Any, holder: MooncakeStore) -> None:
    """Replace a prompt's objects with other bytes and no seals (as a writer without seals would):
    they load unverified, and the output changes."""
    batch = engine.prompts(2)
    first, records = engine.stored_by(llm, batch)
    keys = list(dict.fromkeys(r.key for r in records))
    assert len(keys) == PER_BATCH
    engine.overwrite(holder, keys, torch.randint(0, 255, (records[0].size,), dtype=torch.uint8))
    for key in keys:
        holder.remove(seal_key(key), force=True)  # the seals lie under some of them: the first of each run
    assert holder.batch_is_exist([seal_key(key) for key in keys]) == [0] * len(keys)
    assert llm.reset_prefix_cache()
    unverified_before = engine.worker(llm).stats["chunks_unverified"]
    second = engine.generate(llm, batch)
    assert second["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert engine.worker(llm).stats["chunks_unverified"] - unverified_before == PER_BATCH
    assert second["tokens"] != first["tokens"]


def test_group_semantics_tags_every_object_with_its_chunk(llm: Any) -> None:
    from kvpipe.stages import GROUP_ID_SCOPE

    _, records = engine.stored_by(llm, engine.prompts(41))
    assert len(records) == PER_BATCH
    for record in records:
        assert record.group_id == f"{GROUP_ID_SCOPE}:tiny-llama@{record.chunk_hash.hex()}"
        assert record.key == f"tiny-llama@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{record.chunk_hash.hex()}"


def test_a_failed_load_is_recomputed(
    llm: Any, holder: MooncakeStore, reference: dict[int, list[list[int]]]
) -> None:
    """Objects of the wrong size: the lookup hits, the load fails, vLLM recomputes the blocks."""
    import torch

    batch = engine.prompts(7)
    _, records = engine.stored_by(llm, batch)
    keys = list(dict.fromkeys(r.key for r in records))
    engine.overwrite(holder, keys, torch.zeros(records[0].size // 2, dtype=torch.uint8))
    failed_before = engine.worker(llm).stats["chunks_load_failed"]
    assert llm.reset_prefix_cache()
    again = engine.generate(llm, batch)
    assert engine.worker(llm).stats["chunks_load_failed"] - failed_before == PER_BATCH
    assert again["tokens"] == reference[7]


def test_a_prefix_longer_than_the_staging_slots_loads_what_they_hold_and_computes_the_rest(
    llm: Any, store_section: dict[str, Any]
) -> None:
    """An engine whose staging holds 3 chunks finds 4 stored: a hit of 3, not a load that fails whole."""
    batch = engine.prompts(9)[:1]
    first, _ = engine.stored_by(llm, batch)
    small = kvpipe_transfer({"store": store_section, "staging_blocks": 3})

    (again,) = engine.run_engine_process(small, [{"generate": batch, "max_tokens": engine.MAX_TOKENS}])

    assert again["connector_hits"] == 3 * engine.BLOCK
    assert again["tokens"] == first["tokens"]


def test_on_an_idle_engine_a_reload_loads_before_the_forward_and_once_per_shared_prefix(llm: Any) -> None:
    """No running request would wait for the load: its requests compute in the step that loads it."""
    batch = engine.family(24, 4)
    first, _ = engine.stored_by(llm, batch)
    assert llm.reset_prefix_cache()
    scheduled, worked = Counter(engine.scheduler(llm).stats), Counter(engine.worker(llm).stats)
    second = engine.generate(llm, batch)
    scheduled = Counter(engine.scheduler(llm).stats) - scheduled
    assert Counter(engine.worker(llm).stats)["loads"] - worked["loads"] == 1
    assert scheduled["loads_sync"] == 1 and scheduled["lookups_deferred"] == 0
    assert second["connector_hits"] == engine.SHARED  # the others hit it in vLLM's own cache at once
    assert second["tokens"] == first["tokens"]


def test_the_lookups_of_one_scheduling_step_are_one_store_call(llm: Any) -> None:
    """Four new requests admitted in one step: one ``batch_is_exist``, not one per request."""
    calls = engine.scheduler(llm).stats["lookup_calls"]
    engine.generate(llm, engine.prompts(8, count=4))
    assert engine.scheduler(llm).stats["lookup_calls"] - calls == 1
    assert engine.worker(llm).drain(10.0)


def test_each_saved_object_is_one_buffer(llm: Any) -> None:
    """The worker stages blocks object-major: one buffer per object, not one per layer."""
    _, records = engine.stored_by(llm, engine.prompts(42))
    assert len(records) == PER_BATCH
    assert {len(record.buffers) for record in records} == {1}
    assert {record.size for record in records} == {2 * 64 * 1024}  # two layers' 64 KiB blocks


def test_decode_chunks_are_not_saved_by_default(llm: Any) -> None:
    """A 128-token prompt decoded past 256 tokens stores its prompt's chunk only (save_decode_cache off)."""
    import random

    prompt = [random.Random(9).randrange(1024) for _ in range(engine.BLOCK + 1)]
    before = len(engine.worker(llm).observed)
    engine.launch.generate(llm, [prompt], 2 * engine.BLOCK)
    assert engine.worker(llm).drain(10.0)
    records = [r for r, status in list(engine.worker(llm).observed)[before:] if status.value == "put"]
    assert len(records) == 1


def test_saves_and_loads_start_no_openmp_pool_beside_the_engine_s(llm: Any) -> None:
    """A parallel torch op on a pipeline's thread would give it a pool of its own, and every
    barrier of the engine's forward would then sleep instead of spin (``tests/stages/openmp.py``)."""
    batch = engine.prompts(44)
    engine.stored_by(llm, batch)  # sealed saves
    assert llm.reset_prefix_cache()
    loaded_before = engine.worker(llm).stats["chunks_verified"]
    again = engine.generate(llm, batch)  # verified loads
    assert again["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert engine.worker(llm).stats["chunks_verified"] - loaded_before == PER_BATCH

    assert openmp_workers() <= torch.get_num_threads() - 1  # the engine thread's pool, if any
    assert "kvpipe-staging-copy" in {thread.name for thread in threading.enumerate()}  # the saves' copies ran there


def test_a_request_that_skips_the_prefix_cache_computes_and_leaves_the_others_their_hits(llm: Any) -> None:
    """Prompt logprobs need every prompt token computed, so vLLM zeroes such a request's hit
    after asking the connector: kvpipe's lookup must leave no load planned behind it."""
    batch = engine.family(74, 3)
    first, _ = engine.stored_by(llm, batch)
    assert llm.reset_prefix_cache()
    plain, logprobs = greedy(engine.MAX_TOKENS), greedy(engine.MAX_TOKENS, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": prompt} for prompt in batch]
    loads = engine.scheduler(llm).loads_in_flight

    outputs = llm.generate(prompts, [logprobs, plain, plain], use_tqdm=False)

    assert [list(output.outputs[0].token_ids) for output in outputs] == first["tokens"]
    assert outputs[0].num_cached_tokens == 0
    assert len(outputs[0].prompt_logprobs) == engine.PROMPT_TOKENS
    assert [output.num_cached_tokens for output in outputs[1:]] == [engine.SHARED] * 2
    assert engine.scheduler(llm).loads_in_flight == loads == 0
