"""Prefill on one engine, decode on another: the handoff through the transfer parameters (no engine).

The prefill engine's scheduler side saves a ``do_remote_decode`` request whole and
returns what it stored; the decode engine's waits, without holding a step, until
that is visible. Driven as vLLM's scheduler drives them, on the memory store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.connector.vllm.handoff import FIELD, Handoff, HandoffError
from kvpipe.connector.vllm.scheduler import HANDOFF_POLL_S, SchedulerSide
from kvpipe.connector.vllm.settings import settings_from
from kvpipe.stages.keys import shared_pool_id

from ...stages.kv_fixtures import chain_hashes
from .caches import engine_cache
from .test_scheduler_side import BLOCK, PROMPT, Harness, make_harness, plan_saves

WAIT_S = 2.0


@dataclass
class PDRequest:
    """vLLM's Request as the scheduler side reads it, with the transfer parameters a proxy sent."""

    request_id: str
    block_hashes: tuple[bytes, ...]
    kv_transfer_params: dict[str, Any] | None = field(default=None)
    num_tokens: int = PROMPT
    num_prompt_tokens: int = PROMPT
    num_computed_tokens: int = 0


def _prefill_side() -> SchedulerSide:
    return SchedulerSide(engine_cache(), settings_from({"store": {"kind": "memory"}}), MemoryStore(1 << 20))


def _prefilled(side: SchedulerSide, local_hit: int = 0) -> tuple[PDRequest, list[Any]]:
    """A ``do_remote_decode`` request computed whole in one step (``local_hit`` tokens from the prefix cache)."""
    request = PDRequest("p", chain_hashes(4, salt="pd"), {"do_remote_decode": True})
    side.on_new_request(request)
    side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    request.num_computed_tokens = local_hit
    return request, plan_saves(side, request, PROMPT - local_hit)


def _pool(harness: Harness) -> str:
    return shared_pool_id(harness.side.cache.namespace(0))


def _decode_request(harness: Harness, chunks: int = 4, **changes: Any) -> PDRequest:
    """A decode request whose parameters promise ``chunks`` chunks of the shared prompt."""
    handoff = Handoff.of(harness.hashes, BLOCK, chunks * BLOCK, _pool(harness))
    params = handoff.params()
    params[FIELD].update(changes)
    request = PDRequest("d", harness.hashes, params)
    harness.side.on_new_request(request)
    return request


@pytest.fixture
def decode() -> Harness:
    return make_harness(load_sync_when_idle=False, remote_prefill_wait_s=WAIT_S)


# -- the prefill engine -------------------------------------------------------------------------


def test_a_prefill_for_another_engine_is_saved_whole_even_where_its_own_cache_hit() -> None:
    _, saves = _prefilled(_prefill_side(), local_hit=2 * BLOCK)
    assert [(s.num_saved_tokens, s.num_computed_tokens, s.handoff) for s in saves] == [(0, PROMPT, True)]


def test_a_prefill_for_another_engine_copies_no_chunk_of_its_cache_hit_that_the_store_holds() -> None:
    harness = make_harness()
    harness.store_chunks(2)
    request = PDRequest("p", harness.hashes, {"do_remote_decode": True})
    harness.side.on_new_request(request)
    harness.side.get_num_new_matched_tokens(request, 3 * BLOCK)  # its own cache holds three chunks
    harness.side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    request.num_computed_tokens = 3 * BLOCK

    saves = plan_saves(harness.side, request, PROMPT - 3 * BLOCK)

    assert [(s.num_saved_tokens, s.num_computed_tokens) for s in saves] == [(2 * BLOCK, PROMPT)]


def test_a_finished_prefill_returns_what_it_stored_in_the_standard_parameters() -> None:
    side = _prefill_side()
    request, _ = _prefilled(side)

    _, params = side.request_finished(request)

    assert params is not None and params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert Handoff.from_params(params) == Handoff(
        4 * BLOCK, request.block_hashes[3].hex(), shared_pool_id(side.cache.namespace(0))
    )
    assert side.stats["handoffs_offered"] == 1


def test_a_handoffs_saves_go_first_in_their_step() -> None:
    side = _prefill_side()
    plain = PDRequest("a", chain_hashes(4, salt="plain"))
    handed = PDRequest("b", chain_hashes(4, salt="handed"), {"do_remote_decode": True})
    for request in (plain, handed):
        side.on_new_request(request)
        side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    table = SimpleNamespace(get_block_ids=lambda rid: (list(range(10)),))
    output = SimpleNamespace(
        finished_req_ids=set(),
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=0) for rid in ("a", "b")],
        num_scheduled_tokens={"a": PROMPT, "b": PROMPT},
        kv_connector_block_state=table,
    )
    assert [save.request_id for save in side.build_connector_meta(output).saves] == ["b", "a"]


def test_a_request_without_transfer_parameters_returns_none() -> None:
    side = _prefill_side()
    request = PDRequest("a", chain_hashes(4, salt="plain"))
    side.on_new_request(request)
    assert side.request_finished(request) == (False, None)


def test_an_engine_that_stores_nothing_hands_nothing_over() -> None:
    settings = settings_from({"store": {"kind": "memory"}})
    side = SchedulerSide(engine_cache(), settings, MemoryStore(1 << 20), saves=False)
    request = PDRequest("p", chain_hashes(4, salt="pd"), {"do_remote_decode": True})
    side.on_new_request(request)
    assert side.request_finished(request) == (False, None)


# -- the decode engine --------------------------------------------------------------------------


def test_a_decode_request_asks_again_until_the_promised_chunks_are_visible(decode: Harness) -> None:
    request = _decode_request(decode)
    decode.store_chunks(3)
    assert decode.side.get_num_new_matched_tokens(request, 0) == (None, False)
    decode.store_chunks(4)
    decode.clock.now += HANDOFF_POLL_S
    decode.step()

    assert decode.side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, True)
    assert decode.side.stats["handoffs_waited"] == 1


def test_a_decode_request_whose_chunks_are_there_loads_at_once(decode: Harness) -> None:
    decode.store_chunks(4)
    assert decode.side.get_num_new_matched_tokens(_decode_request(decode), 0) == (4 * BLOCK, True)
    assert decode.side.stats["handoffs_found"] == 1


def test_past_remote_prefill_wait_s_a_decode_request_takes_what_is_there(decode: Harness) -> None:
    request = _decode_request(decode)
    decode.store_chunks(2)
    assert decode.side.get_num_new_matched_tokens(request, 0) == (None, False)
    decode.clock.now += WAIT_S
    decode.step()

    assert decode.side.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, True)
    assert decode.side.stats["handoffs_expired"] == 1


def test_between_polls_a_waiting_decode_request_does_not_ask_the_store(decode: Harness) -> None:
    request = _decode_request(decode)
    decode.side.get_num_new_matched_tokens(request, 0)
    decode.step()
    asked = decode.side.stats["lookup_calls"]

    assert decode.side.get_num_new_matched_tokens(request, 0) == (None, False)
    assert decode.side.stats["lookup_calls"] == asked


def test_a_local_hit_as_long_as_the_promise_waits_for_nothing(decode: Harness) -> None:
    request = _decode_request(decode, tokens=2 * BLOCK, last_hash=decode.hashes[1].hex())
    decode.store_chunks(0)
    assert decode.side.get_num_new_matched_tokens(request, 2 * BLOCK) == (0, False)
    assert decode.side.stats["handoffs_found"] == 1


@pytest.mark.parametrize(
    "changes",
    [
        {"pool": "vllm-mooncake-store:another-model"},
        {"last_hash": "00" * 16},  # the prefill engine hashed the prompt differently
        {"version": 99},
        {"tokens": "many"},
    ],
    ids=["another pool", "another hashing", "another version", "malformed"],
)
def test_parameters_this_engine_cannot_use_are_refused_and_the_prompt_computed(
    decode: Harness, changes: dict[str, Any]
) -> None:
    request = _decode_request(decode, **changes)
    assert decode.side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert decode.side.stats["handoffs_refused"] == 1


def test_with_remote_prefill_wait_s_0_a_decode_request_never_waits() -> None:
    harness = make_harness(load_sync_when_idle=False, remote_prefill_wait_s=0)
    request = _decode_request(harness)
    assert harness.side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert harness.side.stats["handoffs_expired"] == 1


def test_malformed_parameters_name_the_field_and_the_value() -> None:
    with pytest.raises(HandoffError, match=r"kvpipe\.tokens: expected a count >= 0, got -1"):
        Handoff.from_params({FIELD: {"version": 1, "tokens": -1, "last_hash": "", "pool": ""}})
