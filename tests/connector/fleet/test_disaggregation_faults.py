"""Faults between the two halves of a split request, on real processes: each test its own split fleet.

One prefill engine and one decode engine with kvpipe's connector on one Mooncake store
(its objects on one store node). Each test speaks the router's protocol to the engines
directly (the prefill half, then the decode half with the prefill's transfer parameters),
so that a fault can strike between the halves. What every fault must leave true: the
request is answered, as an engine computing it whole answers it, and whatever the decode
engine could not load in time it computed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpipe.connector.engines import launch
from kvpipe.connector.fleet.fleet import Fleet, FleetSpec

from .client import complete, words
from .test_disaggregation import BLOCK, PROMPT_TOKENS, SAVED_WITHIN_S, WAIT_S, decode, handoffs, prefill

pytestmark = [pytest.mark.mooncake, pytest.mark.engine]

WHOLE_BLOCKS = PROMPT_TOKENS // BLOCK
HELD_UP_S = 2.0  # how long the store node is stopped while a decode waits: well inside WAIT_S


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    spec = FleetSpec(
        prefill=1, decode=1, connector_settings={"remote_prefill_wait_s": WAIT_S}, log_dir=tmp_path
    )
    with Fleet(spec) as running:
        yield running


def computed_and_cleared(fleet: Fleet, prompt: str) -> str:
    """The prompt's answer computed whole on the prefill engine; its save landed, then removed from the store.

    The reference every half-request must answer; the store is left without the prompt,
    as before any request of it (the prefill engine's own prefix cache keeps it).
    """
    assert fleet.master is not None and fleet.master.endpoints is not None
    endpoints = fleet.master.endpoints
    reference = complete(fleet.prefills[0].url, str(fleet.model), prompt, max_tokens=8).text
    deadline = time.monotonic() + SAVED_WITHIN_S
    while len(launch.stored_keys(endpoints)) < WHOLE_BLOCKS:
        assert time.monotonic() < deadline, "the prefill engine's save never landed"
        time.sleep(0.1)
    with launch.segment_holder(endpoints, 0) as client:
        assert client.remove_all(force=True) >= 0
    return reference


def store_node_stopped(fleet: Fleet, stopped: bool) -> None:
    pid = fleet.store_nodes[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP if stopped else signal.SIGCONT)


@contextmanager
def store_node_held(fleet: Fleet) -> Iterator[None]:
    """The store node stopped (SIGSTOP) for the block, whatever happens in it: no put to it completes."""
    store_node_stopped(fleet, True)
    try:
        yield
    finally:
        store_node_stopped(fleet, False)


def test_a_save_held_up_by_a_stopped_store_node_is_waited_for_and_loaded_whole(fleet: Fleet) -> None:
    prompt = words(seed=800, count=PROMPT_TOKENS)
    reference = computed_and_cleared(fleet, prompt)
    waited = handoffs(fleet.decoders[0].url, "waited")
    with store_node_held(fleet):
        params = prefill(fleet, prompt)  # answered; its save cannot land while the node is stopped
        threading.Timer(HELD_UP_S, store_node_stopped, (fleet, False)).start()
        text, loaded = decode(fleet, prompt, params)
    assert loaded == WHOLE_BLOCKS * BLOCK
    assert handoffs(fleet.decoders[0].url, "waited") == waited + 1
    assert text == reference


def test_a_prefill_engine_killed_before_its_save_landed_costs_a_recompute_not_a_request(fleet: Fleet) -> None:
    prompt = words(seed=801, count=PROMPT_TOKENS)
    reference = computed_and_cleared(fleet, prompt)
    expired = handoffs(fleet.decoders[0].url, "expired")
    with store_node_held(fleet):
        params = prefill(fleet, prompt)
        fleet.prefills[0].process.signal(signal.SIGKILL)  # its save dies with it

    text, loaded = decode(fleet, prompt, params)

    assert loaded == 0
    assert handoffs(fleet.decoders[0].url, "expired") == expired + 1
    assert text == reference


def test_a_decode_engine_restarted_between_the_halves_loads_the_prompt_whole(fleet: Fleet) -> None:
    prompt = words(seed=802, count=PROMPT_TOKENS)
    reference = computed_and_cleared(fleet, prompt)
    params = prefill(fleet, prompt)
    decoder = fleet.decoders[0]
    decoder.stop()
    decoder.start()
    decoder.wait_ready(fleet.spec.startup_timeout_s)

    text, loaded = decode(fleet, prompt, params)

    assert loaded == WHOLE_BLOCKS * BLOCK
    assert text == reference
