"""Async loads in the real engine: one load per shared prefix, and a stale hit recomputes once.

The engine loads async always (``load_async: true``, ``load_sync_when_idle: false``:
these tests run one pass at a time, on an engine that is otherwise idle) with
``recompute``: a load that fails is a miss. Every test stands alone: its own
prompts, its own counts.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvpipe.connector.bench.launch import close_llm, kvpipe_transfer
from kvpipe.connector.store.mooncake import MooncakeStore

from . import engine

GENERATION_BOUND_S = 120  # a pass that loops (lookup, load, fail, ...) never ends: this ends the test


@pytest.fixture(scope="module")
def llm(store_section: dict[str, Any]) -> Iterator[Any]:
    extra = {"store": store_section, "load_sync_when_idle": False}
    transfer = {**kvpipe_transfer(extra), "kv_load_failure_policy": "recompute"}
    instance = engine.make_llm(transfer)
    yield instance
    close_llm(instance)


@contextmanager
def bounded(seconds: int) -> Iterator[None]:
    """Fail instead of hanging when the block does not end within ``seconds``."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"generation did not end within {seconds} s: a lookup/load loop?")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_async_loads_serve_a_reload(llm: Any) -> None:
    batch = engine.prompts(21)
    first, _ = engine.stored_by(llm, batch)
    assert llm.reset_prefix_cache()
    asked, sync = engine.scheduler(llm).stats["lookup_hit_tokens"], engine.scheduler(llm).stats["loads_sync"]
    second = engine.generate(llm, batch)
    assert second["cached"] == [engine.FULL_HIT] * 2
    assert second["tokens"] == first["tokens"]
    assert engine.scheduler(llm).stats["lookup_hit_tokens"] - asked == 2 * engine.FULL_HIT
    assert engine.scheduler(llm).stats["loads_sync"] == sync


def test_requests_sharing_a_prefix_load_it_once(llm: Any) -> None:
    """Four requests, one stored prefix: one load; the other three hit it in vLLM's own prefix cache."""
    batch = engine.family(22, 4)
    first, _ = engine.stored_by(llm, batch)
    assert llm.reset_prefix_cache()
    loads, deferred = engine.worker(llm).stats["loads"], engine.scheduler(llm).stats["lookups_deferred"]
    spared = engine.scheduler(llm).stats["loads_spared"]
    second = engine.generate(llm, batch)
    assert engine.worker(llm).stats["loads"] - loads == 1
    assert engine.scheduler(llm).stats["lookups_deferred"] - deferred >= 3
    assert engine.scheduler(llm).stats["loads_spared"] - spared == 3  # what kvpipe:loads_spared_total shows
    assert all(cached >= engine.SHARED for cached in second["cached"])
    assert second["connector_hits"] == engine.SHARED  # loaded once; the rest are local hits on it
    assert second["tokens"] == first["tokens"]


def test_a_stale_hit_recomputes_once_and_never_loops(
    llm: Any, holder: MooncakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The objects vanish between the lookup and the load (evicted, a master restarted)."""
    batch = engine.prompts(23)
    first, records = engine.stored_by(llm, batch)
    keys = sorted({r.key for r in records})
    assert keys
    side = engine.scheduler(llm)
    allocated = side.update_state_after_alloc

    def then_evict(request: Any, blocks: Any, num_external_tokens: int) -> None:
        allocated(request, blocks, num_external_tokens)
        if num_external_tokens:
            for key in keys:
                holder.remove(key, force=True)

    monkeypatch.setattr(side, "update_state_after_alloc", then_evict)
    assert llm.reset_prefix_cache()
    before = Counter(side.stats), Counter(engine.worker(llm).stats)
    with bounded(GENERATION_BOUND_S):
        again = engine.generate(llm, batch)
    scheduled, worked = Counter(side.stats) - before[0], Counter(engine.worker(llm).stats) - before[1]
    assert again["tokens"] == first["tokens"]
    assert again["cached"] == [0, 0]
    assert worked["loads"] == 2  # one per request, never a second
    assert scheduled["loads_failed"] == 2
    assert scheduled["lookups_missed_after_failed_load"] == 2
