"""vLLM's ``reset_prefix_cache(reset_connector=True)`` removes this deployment's objects, and only them.

Two deployments of one model share a master, told apart by their cache prefix;
resetting one leaves the other's cache whole (vLLM's own connector resets with
``remove_all``: every tenant's objects).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpipe.connector.engines.launch import close_llm, kvpipe_transfer
from kvpipe.connector.store.mooncake.master import LocalMaster
from kvpipe.stages.keys import is_seal_key

from . import engine
from .conftest import stored_keys

CHUNKS = 2 * engine.FULL_HIT // engine.BLOCK  # objects of one pass over two prompts


def keys_of(master: LocalMaster, prefix: str) -> dict[str, int]:
    """A deployment's keys, counted: its objects and their seals."""
    keys = [key for key in stored_keys(master, seals=True) if key.startswith(f"{prefix}@tiny-llama@")]
    seals = sum(map(is_seal_key, keys))
    return {"objects": len(keys) - seals, "seals": seals}


@pytest.fixture(scope="module")
def reset_run(store_section: dict[str, Any], master: LocalMaster) -> dict[str, Any]:
    """Deployments "scoped-a" and "scoped-b" store the same prompts; then b resets and asks again."""

    def deployment(prefix: str) -> Any:
        return engine.make_llm(kvpipe_transfer({"store": store_section, "cache_prefix": prefix}))

    first = deployment("scoped-a")
    try:
        engine.generate(first, engine.prompts(53))
        assert engine.worker(first).drain()
    finally:
        close_llm(first)
    second = deployment("scoped-b")
    try:
        engine.generate(second, engine.prompts(53))
        assert engine.worker(second).drain()
        before = {prefix: keys_of(master, prefix) for prefix in ("scoped-a", "scoped-b")}
        reset = second.reset_prefix_cache(reset_connector=True)
        after = {prefix: keys_of(master, prefix) for prefix in ("scoped-a", "scoped-b")}
        again = engine.generate(second, engine.prompts(53))
    finally:
        close_llm(second)
    return {"before": before, "reset": reset, "after": after, "again": again}


def test_the_reset_succeeds(reset_run: dict[str, Any]) -> None:
    assert reset_run["reset"] is True


def test_the_reset_removes_every_object_of_its_own_deployment(reset_run: dict[str, Any]) -> None:
    assert reset_run["before"]["scoped-b"]["objects"] == CHUNKS
    assert reset_run["before"]["scoped-b"]["seals"] > 0
    assert reset_run["after"]["scoped-b"] == {"objects": 0, "seals": 0}


def test_the_reset_leaves_another_deployment_on_the_same_master_whole(reset_run: dict[str, Any]) -> None:
    assert reset_run["before"]["scoped-a"]["objects"] == CHUNKS
    assert reset_run["before"]["scoped-a"]["seals"] > 0
    assert reset_run["after"]["scoped-a"] == reset_run["before"]["scoped-a"]


def test_after_the_reset_the_deployment_recomputes_what_it_had_stored(reset_run: dict[str, Any]) -> None:
    assert reset_run["again"]["connector_hits"] == 0
