"""No wrong byte reaches the engine: the fault matrix, in a real vLLM engine on a real master.

Each test stores a batch through kvpipe (every object sealed), damages what the
store holds the way a fault would, clears vLLM's own prefix cache and runs the
batch again: the outputs must equal an engine without a connector's, and the
fault must be counted under its verdict. (With ``integrity: off`` the same damage
reaches the engine: ``test_integrity_off.py``.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import xxhash

from kvpipe.connector.bench.vllm_engine import EngineProcess
from kvpipe.connector.engines.launch import close_llm, kvpipe_transfer
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.stages import Seal, seal_key
from kvpipe.stages.integrity import SEAL_SIZE, key_id

from . import engine

PER_BATCH = 2 * engine.FULL_HIT // engine.BLOCK  # objects of one batch of two prompts


def _transfer(store_section: dict[str, Any]) -> dict[str, Any]:
    extra = {"store": store_section, "enable_group_semantics": True, "staging_blocks": 64}
    return kvpipe_transfer(extra, load_failure_policy="recompute")


@pytest.fixture(scope="module")
def llm(store_section: dict[str, Any], reference: dict[int, list[list[int]]]) -> Iterator[Any]:
    """A kvpipe engine with the default ``integrity: verify`` (bfloat16, as every test engine)."""
    instance = engine.make_llm(_transfer(store_section))
    yield instance
    close_llm(instance)


def _same_size_garbage(holder: MooncakeStore, keys: list[str], size: int) -> None:
    engine.overwrite(holder, keys, torch.randint(0, 255, (size,), dtype=torch.uint8))


def _torn(holder: MooncakeStore, keys: list[str], size: int) -> None:
    """The second half of each object other bytes: a writer that died half way through a put."""
    for key in keys:
        value = engine.read(holder, key, size)
        value[size // 2 :] = torch.randint(0, 255, (size - size // 2,), dtype=torch.uint8)
        engine.overwrite(holder, [key], value)


@pytest.mark.parametrize("damage", [_same_size_garbage, _torn], ids=["overwritten", "torn"])
def test_an_object_whose_bytes_are_not_as_sealed_is_recomputed_and_replaced(
    llm: Any,
    holder: MooncakeStore,
    reference: dict[int, list[list[int]]],
    damage: Callable[[MooncakeStore, list[str], int], None],
) -> None:
    seed = 61 if damage is _same_size_garbage else 62
    batch = engine.prompts(seed)
    _, records = engine.stored_by(llm, batch)
    keys = list(dict.fromkeys(record.key for record in records))
    damage(holder, keys, records[0].size)

    again, counts = engine.rerun(llm, batch)

    assert again["tokens"] == reference[seed]
    assert counts["integrity_failures_corrupt"] == PER_BATCH and counts["chunks_verified"] == 0
    # removed, recomputed, and stored anew with seals that vouch for the new bytes
    assert counts["objects_put"] == PER_BATCH
    assert _sealed_rightly(holder, keys, records[0].size)


def test_a_chunk_whose_seals_are_missing_loads_unverified(
    llm: Any, holder: MooncakeStore, reference: dict[int, list[list[int]]]
) -> None:
    batch = engine.prompts(63)
    _, records = engine.stored_by(llm, batch)
    keys = list(dict.fromkeys(record.key for record in records))
    for key in keys:
        holder.remove(seal_key(key), force=True)  # the seals lie under some of them: the first of each run
    assert holder.batch_is_exist([seal_key(key) for key in keys]) == [0] * len(keys)

    again, counts = engine.rerun(llm, batch)

    assert again["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert again["tokens"] == reference[63]
    assert counts["chunks_unverified"] == PER_BATCH and counts["chunks_load_failed"] == 0


def test_objects_an_engine_of_another_dtype_wrote_under_the_same_keys_are_never_loaded(
    llm: Any,
    holder: MooncakeStore,
    store_section: dict[str, Any],
    reference: dict[int, list[list[int]]],
) -> None:
    """A float16 engine of the same model name writes first: same keys, same sizes, other bytes."""
    batch = engine.prompts(64)
    spec = {"model": str(engine.MODEL_DIR), "transfer": _transfer(store_section), "engine_args": {"dtype": "float16"}}
    with EngineProcess(spec) as float16:  # its saves are drained when it closes, at the block's end
        float16.call({"generate": batch, "max_tokens": engine.MAX_TOKENS})

    again, counts = engine.rerun(llm, batch)

    assert again["tokens"] == reference[64]
    assert counts["integrity_failures_foreign"] == PER_BATCH and counts["chunks_loaded"] == 0


def test_a_seal_vouches_for_the_bytes_the_engine_put(llm: Any, holder: MooncakeStore) -> None:
    _, records = engine.stored_by(llm, engine.prompts(65))

    assert len(records) == PER_BATCH
    assert _sealed_rightly(holder, [record.key for record in records], records[0].size)


def _sealed_rightly(holder: MooncakeStore, keys: list[str], size: int) -> bool:
    """Whether each of ``keys`` (a prompt's objects, of ``size`` bytes) is stored and named by a seal stored
    under one of them with its size and checksum (a seal lies under the first object of a run it vouches for)."""
    entries = {}
    seal_keys = [seal_key(key) for key in keys]
    for key, present in zip(seal_keys, holder.batch_is_exist(seal_keys), strict=True):
        if present != 1:
            continue
        seal = Seal.unpack(bytes(engine.read(holder, key, SEAL_SIZE).tolist()))
        entries.update({} if seal is None else {entry.key_id: entry for entry in seal.entries})
    for key in keys:
        data = bytes(engine.read(holder, key, size).tolist())
        entry = entries.get(key_id(key))
        if entry is None or (entry.size, entry.checksum) != (size, xxhash.xxh3_64_intdigest(data)):
            return False
    return True
