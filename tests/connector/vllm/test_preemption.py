"""Preemption in the real engine: a request that loses its blocks to others comes back whole.

A cache of 16 blocks and six 600-token prompts decoding 160 tokens each: vLLM
admits what fits, and once the running requests outgrow the cache it preempts
one (frees its blocks, takes its computed tokens back to 0) and schedules it
again later. The preempted request then finds its own saved prefix in the store
(or in vLLM's prefix cache) and its outputs must equal an engine's that never
had a connector.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvpipe.connector.engines.launch import close_llm, counters, generate, kvpipe_transfer

from . import engine

#: 16 blocks of the tiny model's KV: two prompts and their decode outgrow it
CACHE_BYTES = (64 << 20) * 16 // 511
OUTPUT_TOKENS = 160
PREEMPTIONS = "vllm:num_preemptions"


def small_llm(transfer: dict[str, Any] | None) -> Any:
    return engine.make_llm(transfer, kv_cache_memory_bytes=CACHE_BYTES)


def run(llm: Any, batch: list[list[int]]) -> list[list[int]]:
    return generate(llm, batch, OUTPUT_TOKENS).tokens


def preemptions(llm: Any) -> int:
    return counters(llm, PREEMPTIONS)[PREEMPTIONS]


BATCH = engine.prompts(75, 6)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """The batch's outputs from an engine of the same cache without a connector."""
    llm = small_llm(None)
    try:
        return run(llm, BATCH)
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def llm(store_section: dict[str, Any], expected: list[list[int]]) -> Iterator[Any]:
    """(After ``expected``: vLLM keeps one KV-connector agent per process, which an engine
    without a connector made while this one lives would find and fail on.)"""
    transfer = kvpipe_transfer({"store": store_section}, load_failure_policy="recompute")
    instance = small_llm(transfer)
    yield instance
    close_llm(instance)


def test_requests_preempted_while_their_prefixes_are_saved_come_back_with_the_same_outputs(
    llm: Any, expected: list[list[int]]
) -> None:
    before = preemptions(llm)
    outputs = run(llm, BATCH)
    assert preemptions(llm) > before  # the scenario happened
    assert outputs == expected
    assert engine.worker(llm).drain(10.0)

    assert llm.reset_prefix_cache()
    loaded = engine.worker(llm).stats["chunks_loaded"]
    again = run(llm, BATCH)  # every prompt's prefix now from the store, preempted or not
    assert again == expected
    assert engine.worker(llm).stats["chunks_loaded"] - loaded >= len(BATCH) * engine.FULL_HIT // engine.BLOCK
