"""Prefill on one engine, decode on another, through the store: a split fleet on real processes.

One prefill engine (``kv_both``) and one decode engine (``kv_consumer``) with kvpipe's
connector on one Mooncake store, vLLM's router in prefill/decode mode in front: the
router prefills each request (``max_tokens: 1``, ``do_remote_decode``), then sends it
with the answer's transfer parameters to the decode engine, which must load every
whole block of the prompt from the store however late the prefill's save lands. The
fault tests speak the same protocol to each engine directly, as the router would.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from kvpipe.connector.engines import launch
from kvpipe.connector.fleet.fleet import Fleet, FleetSpec
from kvpipe.connector.vllm.handoff import FIELD

from .client import EXTERNAL_HITS, REQUEST_TIMEOUT_S, complete, counter, words

pytestmark = [pytest.mark.mooncake, pytest.mark.engine]

BLOCK = 128  # the tiny Llama's block size on the CPU build
PROMPT_TOKENS = 1000  # 7 whole blocks and a partial one
#: the decode engine's remote_prefill_wait_s: the save deadline (save_deadline_s, 10 s), past which no
#: save starts a store call, so that every save that can still land is waited for on a busy machine
WAIT_S = 10.0
HANDOFFS = "kvpipe:handoffs_total"
SAVED_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    spec = FleetSpec(
        prefill=1,
        decode=1,
        # the decode engine stores what it generates too, so a conversation's next turn loads it
        connector_settings={"remote_prefill_wait_s": WAIT_S, "save_decode_cache": True},
        log_dir=tmp_path_factory.mktemp("split"),
    )
    with Fleet(spec) as running:
        started = set(running.processes())
        yield running
    assert not [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def handoffs(url: str, outcome: str) -> float:
    """A replica's count of handoffs that ended with ``outcome``."""
    return counter(url, f'{HANDOFFS}{{outcome="{outcome}"}}')


def prefill(fleet: Fleet, prompt: str) -> dict[str, Any]:
    """What the router does first: the prompt prefilled on the prefill engine; the answer's transfer parameters."""
    body = {
        "model": str(fleet.model),
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    request = urllib.request.Request(
        f"{fleet.prefills[0].url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:  # noqa: S310 - loopback
        params = json.loads(response.read())["kv_transfer_params"]
    assert isinstance(params, dict) and FIELD in params
    return params


def decode(fleet: Fleet, prompt: str, params: dict[str, Any]) -> tuple[str, float]:
    """What the router does next: the request, with those parameters, on the decode engine; its text and loads."""
    url = fleet.decoders[0].url
    before = counter(url, EXTERNAL_HITS)
    answer = complete(url, str(fleet.model), prompt, max_tokens=8, extra={"kv_transfer_params": params})
    return answer.text, counter(url, EXTERNAL_HITS) - before


def computed_whole(fleet: Fleet, prompt: str) -> str:
    """The prompt's answer from an engine that computes it itself (the prefill engine, a whole request)."""
    return complete(fleet.prefills[0].url, str(fleet.model), prompt, max_tokens=8).text


def test_back_to_back_prompts_through_the_router_are_all_loaded_on_the_decode_engine(fleet: Fleet) -> None:
    decoder = fleet.decoders[0].url
    loaded_before = counter(decoder, EXTERNAL_HITS)
    prompts = [words(seed=500 + i, count=PROMPT_TOKENS) for i in range(4)]
    answers = [complete(fleet.url, str(fleet.model), prompt, max_tokens=8) for prompt in prompts]
    loaded = counter(decoder, EXTERNAL_HITS) - loaded_before
    assert [answer.prompt_tokens for answer in answers] == [PROMPT_TOKENS] * 4
    assert loaded == 4 * (PROMPT_TOKENS // BLOCK) * BLOCK  # every whole block, none recomputed
    assert [answer.text for answer in answers] == [computed_whole(fleet, prompt) for prompt in prompts]


def test_chunks_that_never_land_are_waited_for_until_the_deadline_then_computed(fleet: Fleet) -> None:
    assert fleet.master is not None and fleet.master.endpoints is not None
    endpoints = fleet.master.endpoints
    prompt = words(seed=600, count=PROMPT_TOKENS)
    objects = len(launch.stored_keys(endpoints))
    params = prefill(fleet, prompt)
    deadline = time.monotonic() + SAVED_WITHIN_S
    while len(launch.stored_keys(endpoints)) < objects + PROMPT_TOKENS // BLOCK:  # landed: none comes later
        assert time.monotonic() < deadline, "the prefill engine's save never landed"
        time.sleep(0.1)
    with launch.segment_holder(endpoints, 0) as client:  # the save lost: as if it never landed
        assert client.remove_all(force=True) >= 0
    expired = handoffs(fleet.decoders[0].url, "expired")

    text, loaded = decode(fleet, prompt, params)

    assert loaded == 0
    assert handoffs(fleet.decoders[0].url, "expired") == expired + 1
    assert text == computed_whole(fleet, prompt)


def test_parameters_of_another_deployment_are_refused_and_the_request_looked_up_as_any(fleet: Fleet) -> None:
    """Not waited for: what the lookup finds of its own keys loads (the prefill's save may have landed)."""
    prompt = words(seed=700, count=PROMPT_TOKENS)
    params = prefill(fleet, prompt)
    params[FIELD]["pool"] = "vllm-mooncake-store:another-model"
    refused = handoffs(fleet.decoders[0].url, "refused")

    text, _ = decode(fleet, prompt, params)

    assert handoffs(fleet.decoders[0].url, "refused") == refused + 1
    assert text == computed_whole(fleet, prompt)


def test_a_conversations_next_turn_loads_the_answer_the_decode_engine_generated(fleet: Fleet) -> None:
    """Turn 2's prefill finds turn 1's prompt in its own cache and turn 1's answer in the store."""
    assert fleet.master is not None and fleet.master.endpoints is not None
    endpoints = fleet.master.endpoints
    model, prefiller = str(fleet.model), fleet.prefills[0].url
    objects = len(launch.stored_keys(endpoints))
    first_prompt = words(seed=900, count=600)  # 4 whole blocks and 88 tokens
    answer = complete(fleet.url, model, first_prompt, max_tokens=300)
    # whole blocks of the conversation so far: the prefill engine stores 4, the decode engine 3
    answered = (600 + 300) // BLOCK
    deadline = time.monotonic() + SAVED_WITHIN_S
    while len(launch.stored_keys(endpoints)) < objects + answered:
        assert time.monotonic() < deadline, "the decode engine's save of its answer never landed"
        time.sleep(0.1)
    loaded_before = counter(prefiller, EXTERNAL_HITS)

    next_prompt = f"{first_prompt} {answer.text} {words(seed=901, count=40)}"
    second = complete(fleet.url, model, next_prompt, max_tokens=8)

    assert (answer.prompt_tokens, second.prompt_tokens) == (600, 940)
    assert counter(prefiller, EXTERNAL_HITS) - loaded_before == (answered - 600 // BLOCK) * BLOCK
