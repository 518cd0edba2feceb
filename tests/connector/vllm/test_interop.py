"""KVPipeConnector and vLLM's own MooncakeStoreConnector share one cache, both ways."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpipe.connector.engines.launch import close_llm, kvpipe_transfer, mooncake_transfer, vllm_mooncake_env
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster
from kvpipe.stages import seal_key

from . import engine
from .conftest import stored_keys, wait_for_keys

PER_BATCH = 2 * engine.FULL_HIT // engine.BLOCK  # objects of one batch of two prompts


def test_objects_are_interchangeable_with_vllm_mooncake_connector(
    master: LocalMaster,
    store_section: dict[str, Any],
    mooncake_json: Path,
    reference: dict[int, list[list[int]]],
) -> None:
    kvpipe = kvpipe_transfer({"store": store_section})

    # kvpipe stores prompts 3
    llm = engine.make_llm(kvpipe)
    try:
        before = len(stored_keys(master))
        stored = engine.generate(llm, engine.prompts(3))
        assert stored["cached"] == [0, 0]
    finally:
        close_llm(llm)  # drains its saves
    assert len(stored_keys(master)) == before + PER_BATCH

    # vLLM's connector (in a process of its own: it leaves a thread behind) hits them,
    # and stores prompts 4
    commands = [engine.gen(3), engine.gen(4), {"sleep": 1}]
    hit, own, _ = engine.run_engine_process(mooncake_transfer(), commands, vllm_mooncake_env(mooncake_json))
    keys = wait_for_keys(master, before + 2 * PER_BATCH)
    assert hit["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert hit["tokens"] == reference[3]
    assert own["cached"] == [0, 0]
    assert len(keys) == before + 2 * PER_BATCH

    # kvpipe hits what vLLM's connector stored
    llm = engine.make_llm(kvpipe)
    try:
        back = engine.generate(llm, engine.prompts(4))
        unverified = engine.worker(llm).stats["chunks_unverified"]  # vLLM's connector writes no seals
    finally:
        close_llm(llm)
    print(
        "mooncake->kvpipe",
        back["cached"],
        back["seconds"],
        "s; kvpipe->mooncake",
        hit["cached"],
        hit["seconds"],
        "s",
    )
    assert back["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert back["tokens"] == reference[4] == own["tokens"]
    assert unverified == PER_BATCH


#: store_tp_size 2 over the CPU build's LBHNC cache: two head shards per block, a namespace both share
SHARDED = "@store_tp:2@store_pp:1@store_format:tp_shared_lbhnc@"


def test_a_sharded_store_is_interchangeable_with_vllm_mooncake_connector(
    master: LocalMaster,
    store_section: dict[str, Any],
    mooncake_json: Path,
    reference: dict[int, list[list[int]]],
) -> None:
    """``store_tp_size: 2`` on both: a TP 1 engine stores and loads two head shards per block, both ways."""
    sharing = {"store_tp_size": 2}
    llm = engine.make_llm(kvpipe_transfer({"store": store_section, **sharing}))
    try:
        stored = engine.generate(llm, engine.prompts(5))
    finally:
        close_llm(llm)  # drains its saves
    assert stored["tokens"] == reference[5]
    sharded = [key for key in stored_keys(master) if SHARDED in key]
    assert len(sharded) == 2 * PER_BATCH
    assert {key.split(SHARDED)[1].split("@")[0] for key in sharded} == {"tp_rank:0", "tp_rank:1"}

    commands = [engine.gen(5), engine.gen(6), {"sleep": 1}]
    env = vllm_mooncake_env(mooncake_json)
    hit, own, _ = engine.run_engine_process(mooncake_transfer(sharing), commands, env)
    assert hit["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert hit["tokens"] == reference[5]
    assert own["cached"] == [0, 0]

    llm = engine.make_llm(kvpipe_transfer({"store": store_section, **sharing}))
    try:
        back = engine.generate(llm, engine.prompts(6))
    finally:
        close_llm(llm)
    assert back["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert back["tokens"] == reference[6] == own["tokens"]


def test_objects_moved_layer_by_layer_are_interchangeable_with_vllm_mooncake_connector(
    master: LocalMaster,
    holder: MooncakeStore,
    store_section: dict[str, Any],
    mooncake_json: Path,
    reference: dict[int, list[list[int]]],
) -> None:
    """kvpipe saves layer by layer, vLLM's connector loads them whole; it saves whole, kvpipe loads layer
    by layer; and what kvpipe writes layer by layer is byte for byte what vLLM's connector wrote."""
    kvpipe = kvpipe_transfer({"store": store_section, **engine.LAYERWISE})
    llm = engine.make_llm(kvpipe)
    try:
        before = set(stored_keys(master))
        assert engine.generate(llm, engine.prompts(75))["cached"] == [0, 0]
        assert engine.worker(llm).drain(10.0)
        assert engine.worker(llm).stats["saves_layered"] >= 2
    finally:
        close_llm(llm)
    ours = set(stored_keys(master)) - before
    assert len(ours) == PER_BATCH

    commands = [engine.gen(75), engine.gen(76), {"sleep": 1}]
    hit, own, _ = engine.run_engine_process(mooncake_transfer(), commands, vllm_mooncake_env(mooncake_json))
    assert hit["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert hit["tokens"] == reference[75]
    theirs = sorted(set(wait_for_keys(master, len(before) + 2 * PER_BATCH)) - before - ours)
    assert len(theirs) == PER_BATCH

    llm = engine.make_llm(kvpipe)
    try:
        back = engine.generate(llm, engine.prompts(76))
        counts = engine.worker(llm).stats
        assert back["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
        assert back["tokens"] == reference[76] == own["tokens"]
        assert (counts["loads_layered"], counts["chunks_unverified"]) == (2, PER_BATCH)
        # the same prompts computed and saved by kvpipe, layer by layer, over vLLM's objects removed
        written_by_vllm = engine.objects(holder, theirs)
        for key in theirs:
            assert holder.remove(key, force=True) == 0
        assert llm.reset_prefix_cache()
        assert engine.generate(llm, engine.prompts(76))["cached"] == [0, 0]
        assert engine.worker(llm).drain(10.0)
    finally:
        close_llm(llm)
    assert engine.objects(holder, theirs) == written_by_vllm
    assert holder.batch_is_exist([seal_key(key) for key in theirs]).count(1) >= 1  # kvpipe's seals now name them

