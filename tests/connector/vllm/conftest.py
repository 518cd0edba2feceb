"""A real mooncake master, a segment-holder client, and the no-connector reference outputs.

Engines get ``global_segment_size: 0``: their objects go to the holder's segment, so
they outlive the engine that stored them (a second engine, another process, another
connector can hit them). The master and the holder live for the session, but each test
module's engines start on an empty store (:func:`empty_store`): what a module finds
stored is what it stored, whichever modules ran before it and whatever prompts they sent.
Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
unless a test starts a process in vLLM's default mode.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpipe.connector.engines import launch
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster

from . import engine


@pytest.fixture(scope="session", autouse=True)
def _in_process_engines() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        patch.setenv("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "127.0.0.1")
        patch.delenv("PYTHONHASHSEED", raising=False)  # all processes must agree on it
        yield


@pytest.fixture(scope="session")
def master() -> Iterator[LocalMaster]:
    with LocalMaster() as running:
        yield running


@pytest.fixture(scope="session")
def holder(master: LocalMaster) -> Iterator[MooncakeStore]:
    """A client that mounts the segment every engine's objects live in."""
    assert master.endpoints is not None
    with launch.segment_holder(master.endpoints, "256MB") as store:
        yield store


@pytest.fixture(scope="module")
def empty_store(master: LocalMaster, holder: MooncakeStore) -> LocalMaster:
    """The session's master, emptied for this module: every object, leased or not, removed.

    A module's "the first pass misses" then holds by construction, not because no
    other module happened to send the same prompt.
    """
    deadline = time.monotonic() + 10.0
    while holder.remove_all(force=True) < 0 or stored_keys(master, seals=True):
        assert time.monotonic() < deadline, "the session's master would not empty"
        time.sleep(0.05)
    return master


@pytest.fixture(scope="module")
def store_section(empty_store: LocalMaster) -> dict[str, Any]:
    """The kvpipe ``store`` section of an engine on the test master (no segment of its own)."""
    assert empty_store.endpoints is not None
    return launch.store_section(empty_store.endpoints)


@pytest.fixture(scope="module")
def mooncake_json(tmp_path_factory: pytest.TempPathFactory, empty_store: LocalMaster) -> Path:
    """vLLM's Mooncake JSON for the test master, standalone-store mode (no segment)."""
    master = empty_store
    assert master.endpoints is not None
    path = tmp_path_factory.mktemp("mooncake") / "mooncake.json"
    path.write_text(json.dumps(launch.vllm_mooncake_config(master.endpoints)))
    return path


@pytest.fixture(scope="session")
def reference() -> dict[int, list[list[int]]]:
    """Greedy outputs of an engine WITHOUT a connector, per prompt seed."""
    llm = engine.make_llm(None)
    try:
        # 11: test_saves_in_flight's; 61-66: the integrity tests'; 71-80: the layer-wise tests'
        seeds = (*range(1, 8), 11, *range(61, 67), *range(71, 81))
        return {seed: engine.generate(llm, engine.prompts(seed))["tokens"] for seed in seeds}
    finally:
        launch.close_llm(llm)


def stored_keys(master: LocalMaster, *, seals: bool = False) -> list[str]:
    """The objects' keys the master holds; with ``seals``, their seals' too."""
    assert master.endpoints is not None
    return launch.stored_keys(master.endpoints, seals=seals)


def wait_for_keys(master: LocalMaster, count: int, timeout_s: float = 20.0) -> list[str]:
    """Poll until the master holds at least ``count`` keys (saves are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        keys = stored_keys(master)
        if len(keys) >= count or time.monotonic() > deadline:
            return keys
        time.sleep(0.05)
