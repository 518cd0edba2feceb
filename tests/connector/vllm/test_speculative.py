"""Speculative decoding that drafts from the target's hidden states (EAGLE) in the real engine.

Such a drafter needs the hidden states of the tokens before the first the engine
computes, so the engine recomputes the last block of every prefix hit, its own
prefix cache's included. A store hit must stop there too: the tiny Llama with a
one-layer EAGLE head (dummy weights), on the session's master.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpipe.connector.bench.vllm_engine import EngineProcess
from kvpipe.connector.engines import launch
from kvpipe.connector.vllm.engine_cache import recomputes_last_block

from . import engine

EAGLE_HEAD = launch.model_dir("tiny-eagle", {**launch.TINY_LLAMA, "num_hidden_layers": 1})
SPECULATIVE = {"method": "eagle", "model": str(EAGLE_HEAD), "num_speculative_tokens": 2}
#: a prompt's hit when all its whole blocks are stored: the last one is recomputed
SHORT_HIT = engine.FULL_HIT - engine.BLOCK


@pytest.fixture(scope="module")
def llm(store_section: dict[str, Any]) -> Iterator[Any]:
    transfer = launch.kvpipe_transfer({"store": store_section}, load_failure_policy="recompute")
    with engine.running(transfer, speculative_config=SPECULATIVE) as instance:
        yield instance


def test_an_eagle_engine_gets_from_the_store_the_hit_its_own_prefix_cache_gives(llm: Any) -> None:
    """Every whole block of the prompts is stored; both hits leave the last one to recompute."""
    batch = engine.prompts(906)
    first = engine.generate(llm, batch)
    assert engine.worker(llm).drain(10.0)
    own = engine.generate(llm, batch)  # the engine's own prefix cache holds the prompts
    assert llm.reset_prefix_cache()
    from_store = engine.generate(llm, batch)

    assert own["local_hits"] == from_store["connector_hits"] == 2 * SHORT_HIT
    assert own["connector_hits"] == from_store["local_hits"] == 0
    assert from_store["tokens"] == first["tokens"]


def test_vllms_connector_and_kvpipe_load_what_the_other_stored_and_both_leave_the_last_block(
    llm: Any, mooncake_json: Path
) -> None:
    """vLLM's ``MooncakeStoreConnector`` under the same EAGLE head, in a process of its own."""
    ours, theirs = engine.prompts(907), engine.prompts(908)
    stored, _ = engine.stored_by(llm, ours)
    spec = {
        "model": str(engine.MODEL_DIR),
        "transfer": launch.mooncake_transfer(),
        "engine_args": {"speculative_config": SPECULATIVE},
    }
    with EngineProcess(spec, launch.vllm_mooncake_env(mooncake_json)) as process:
        hit, own, _ = (
            process.call(command)
            for command in (
                {"generate": ours, "max_tokens": engine.MAX_TOKENS},
                {"generate": theirs, "max_tokens": engine.MAX_TOKENS},
                {"sleep": 1},  # its saves land
            )
        )
    back = engine.generate(llm, theirs)

    assert hit["cached"] == back["cached"] == [SHORT_HIT, SHORT_HIT]
    assert (hit["tokens"], back["tokens"]) == (stored["tokens"], own["tokens"])


@pytest.mark.parametrize(
    ("speculative", "recomputes"),
    [
        (None, False),
        (SimpleNamespace(use_eagle_block_drop=lambda: True, use_eagle=lambda: True), True),
        (SimpleNamespace(use_eagle_block_drop=lambda: False, use_eagle=lambda: True), False),  # switched off
        (SimpleNamespace(use_eagle=lambda: True), True),  # a vLLM without the switch
        (SimpleNamespace(use_eagle=lambda: False), False),  # e.g. n-gram drafts
    ],
)
def test_the_last_block_is_recomputed_where_the_engine_drops_it_from_its_own_hits(
    speculative: Any, recomputes: bool
) -> None:
    assert recomputes_last_block(SimpleNamespace(speculative_config=speculative)) is recomputes
