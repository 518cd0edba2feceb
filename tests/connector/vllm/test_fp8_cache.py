"""An fp8 KV cache (``kv_cache_dtype``) in the real engine, on the session's master.

Its blocks are one byte an element, so an engine of the other fp8 format (e4m3
against e5m2) of the same model writes objects of the same keys and sizes whose
bytes mean other numbers: the cache dtype is part of the seals' fingerprint, and
such objects must never be loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvpipe.connector.bench.vllm_engine import EngineProcess
from kvpipe.connector.engines import launch

from . import engine

PER_BATCH = 2 * engine.FULL_HIT // engine.BLOCK  # objects of one batch of two prompts


def _transfer(store_section: dict[str, Any]) -> dict[str, Any]:
    return launch.kvpipe_transfer({"store": store_section}, load_failure_policy="recompute")


@pytest.fixture(scope="module")
def llm(store_section: dict[str, Any]) -> Iterator[Any]:
    with engine.running(_transfer(store_section), kv_cache_dtype="fp8_e5m2") as instance:
        yield instance


def test_an_fp8_cache_is_stored_and_loaded_whole(llm: Any) -> None:
    batch = engine.prompts(910)
    first = engine.generate(llm, batch)
    assert engine.worker(llm).drain(10.0)

    again, counts = engine.rerun(llm, batch)

    assert again["connector_hits"] == 2 * engine.FULL_HIT and again["local_hits"] == 0
    assert again["tokens"] == first["tokens"]
    assert counts["chunks_loaded"] == PER_BATCH


def test_objects_of_the_other_fp8_format_under_the_same_keys_are_never_loaded(
    llm: Any, store_section: dict[str, Any]
) -> None:
    batch = engine.prompts(911)
    spec = {
        "model": str(engine.MODEL_DIR),
        "transfer": _transfer(store_section),
        "engine_args": {"kv_cache_dtype": "fp8_e4m3"},
    }
    with EngineProcess(spec) as e4m3:  # its saves are drained when it closes
        e4m3.call({"generate": batch, "max_tokens": engine.MAX_TOKENS})

    _, counts = engine.rerun(llm, batch)

    assert counts["integrity_failures_foreign"] == PER_BATCH and counts["chunks_loaded"] == 0
