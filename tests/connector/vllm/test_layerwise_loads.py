"""Layer-wise loads and saves in a real vLLM engine on a real master: outputs equal, nothing wrong stored.

Each test stores a batch through kvpipe, layer by layer (``save_layerwise``),
clears vLLM's own prefix cache and runs the batch again with ``load_layerwise``
(and ``load_async: false``, so every load runs in its request's step): the
objects are read layer by layer while the forward runs, the engine waiting
before each attention layer for that layer only. Both load paths: through the
staging slots (every device cache's) and straight into a CPU cache's blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpipe.connector.engines.launch import close_llm, kvpipe_transfer
from kvpipe.connector.store.mooncake import MooncakeStore

from . import engine

PER_BATCH = 2 * engine.FULL_HIT // engine.BLOCK  # objects of one batch of two prompts


@pytest.fixture(scope="module", params=[True, False], ids=["via-staging", "in-place"])
def llm(request: pytest.FixtureRequest, store_section: dict[str, Any]) -> Iterator[Any]:
    extra = {
        "store": store_section,
        "load_layerwise": True,
        "save_layerwise": True,
        "load_async": False,
        "load_via_staging": request.param,
        "staging_blocks": 64,
    }
    instance = engine.make_llm(kvpipe_transfer(extra, load_failure_policy="recompute"))
    yield instance
    close_llm(instance)


def _seed(llm: Any, base: int) -> int:
    """One seed per test and engine: the two engines share the store."""
    return base + (0 if engine.worker(llm).settings.load_via_staging else 2)


def test_a_stored_prefix_loads_layer_by_layer_and_the_outputs_equal_an_engine_without_a_connector(
    llm: Any, reference: dict[int, list[list[int]]]
) -> None:
    seed = _seed(llm, 71)
    batch = engine.prompts(seed)
    engine.stored_by(llm, batch)

    again, counts = engine.rerun(llm, batch)

    assert again["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert again["tokens"] == reference[seed]
    assert (counts["loads_layered"], counts["chunks_loaded"], counts["chunks_verified"]) == (2, PER_BATCH, PER_BATCH)
    assert counts["loads_layer_late"] == 0 and counts["chunks_load_failed"] == 0
    assert engine.worker(llm).stats["saves_layered"] >= 2  # the first pass saved its prompts layer by layer


def test_an_object_damaged_in_the_store_fails_its_blocks_in_the_step_and_is_recomputed(
    llm: Any, holder: MooncakeStore, reference: dict[int, list[list[int]]]
) -> None:
    seed = _seed(llm, 72)
    batch = engine.prompts(seed)
    _, records = engine.stored_by(llm, batch)
    keys = list(dict.fromkeys(record.key for record in records))
    engine.overwrite(holder, keys, torch.randint(0, 255, (records[0].size,), dtype=torch.uint8))

    again, counts = engine.rerun(llm, batch)

    assert again["tokens"] == reference[seed]
    assert counts["integrity_failures_corrupt"] == PER_BATCH and counts["chunks_loaded"] == 0
    assert counts["objects_put"] == PER_BATCH  # removed, recomputed, stored anew (layer by layer)
    assert counts["object_failures_called_off"] == 0  # the step that failed had no save of its own


def test_a_layer_damaged_in_the_store_fails_its_blocks_and_the_outputs_equal_an_engine_without_a_connector(
    llm: Any, holder: MooncakeStore, reference: dict[int, list[list[int]]]
) -> None:
    """The last layer of every object other bytes, its seals intact: caught at that layer, before its attention."""
    seed = _seed(llm, 77)
    batch = engine.prompts(seed)
    _, records = engine.stored_by(llm, batch)
    keys = list(dict.fromkeys(record.key for record in records))
    size = records[0].size
    for key in keys:
        value = engine.read(holder, key, size)
        value[size // 2 :] ^= 0xFF  # the tiny model's second (last) layer
        engine.overwrite(holder, [key], value)

    again, counts = engine.rerun(llm, batch)

    assert again["tokens"] == reference[seed]
    assert counts["integrity_failures_corrupt"] == PER_BATCH and counts["chunks_loaded"] == 0
    assert counts["objects_put"] == PER_BATCH  # removed, recomputed, stored anew
