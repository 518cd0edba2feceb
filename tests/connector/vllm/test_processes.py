"""Across processes: a new engine process hits what another engine stored, and vLLM's
default multiprocess mode (scheduler and worker connector in different processes) works."""

from __future__ import annotations

from typing import Any

import pytest

from kvpipe.connector.engines.launch import close_llm, kvpipe_transfer

from . import engine


@pytest.fixture(scope="module")
def multiprocess_run(store_section: dict[str, Any], reference: dict[int, list[list[int]]]) -> dict[str, Any]:
    transfer = kvpipe_transfer({"store": store_section})
    # the first engine, in this process, stores prompts 5
    llm = engine.make_llm(transfer)
    try:
        first = engine.generate(llm, engine.prompts(5))
    finally:
        close_llm(llm)
    assert first["cached"] == [0, 0]
    # the second, a new process in vLLM's default (multiprocess) mode
    commands = [engine.gen(5), engine.gen(6), {"sleep": 1}, {"reset": True}, engine.gen(6)]
    steps = engine.run_engine_process(transfer, commands, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    return {"first": first, "steps": steps}


def test_a_new_engine_process_hits_what_another_stored(
    multiprocess_run: dict[str, Any], reference: dict[int, list[list[int]]]
) -> None:
    hit = multiprocess_run["steps"][0]
    assert hit["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert hit["tokens"] == reference[5] == multiprocess_run["first"]["tokens"]


def test_multiprocess_mode_saves_and_loads(
    multiprocess_run: dict[str, Any], reference: dict[int, list[list[int]]]
) -> None:
    _, fresh, _, reset, again = multiprocess_run["steps"]
    assert fresh["cached"] == [0, 0]
    assert reset == {"reset": True}
    assert again["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert fresh["tokens"] == again["tokens"] == reference[6]
