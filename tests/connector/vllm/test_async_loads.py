"""Async loads in the real engine: one load per shared prefix, a stale hit recomputes once, aborts.

The engine loads async always (``load_async: true``, ``load_sync_when_idle: false``:
these tests run one pass at a time, on an engine that is otherwise idle) with
``recompute``: a load that fails is a miss. Every test stands alone: its own
prompts, its own counts.

A client that goes away (vLLM aborts its request) while the request's load is in
flight must not free blocks the load still writes: vLLM holds them until the
worker reports the load ended, so the load must end and be reported, landed or
failed, whatever became of its request.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvpipe.connector.engines.launch import close_llm, greedy, kvpipe_transfer, vllm_scheduler
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.connector.vllm.metrics import STAGING_SLOTS_IN_USE

from . import engine

GENERATION_BOUND_S = 120  # a pass that loops (lookup, load, fail, ...) never ends: this ends the test


@pytest.fixture(scope="module")
def llm(store_section: dict[str, Any]) -> Iterator[Any]:
    extra = {"store": store_section, "load_sync_when_idle": False}
    transfer = kvpipe_transfer(extra, load_failure_policy="recompute")
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


class HeldGets:
    """Every get of a Mooncake client in this process waits until :meth:`release`.

    (Only the engine's loads get here.)
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached, self._gate = threading.Event(), threading.Event()
        get = MooncakeStore.batch_get_into_multi_buffers

        def held(client: MooncakeStore, *args: Any) -> list[int]:
            self.reached.set()
            assert self._gate.wait(GENERATION_BOUND_S)
            return get(client, *args)

        monkeypatch.setattr(MooncakeStore, "batch_get_into_multi_buffers", held)

    def release(self) -> None:
        self._gate.set()


def add_requests(llm: Any, batch: list[list[int]]) -> None:
    """Requests ``r0``, ``r1``, ... of ``batch``, added to the engine without stepping it."""
    params = greedy(engine.MAX_TOKENS)
    for index, prompt in enumerate(batch):
        llm.llm_engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, params)


def step_until(llm: Any, done: Any, outputs: dict[str, list[int]]) -> None:
    """Step the engine until ``done()``, collecting finished requests' tokens; fail past the bound."""
    deadline = time.monotonic() + GENERATION_BOUND_S
    while not done():
        assert time.monotonic() < deadline, "the engine did not get there"
        for output in llm.llm_engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        time.sleep(0.01)  # an idle step returns at once: let the load's threads run


def engine_requests(llm: Any) -> dict[str, Any]:
    """vLLM's requests by the id it was given (vLLM adds a suffix of its own)."""
    requests = vllm_scheduler(llm).requests
    return {rid.rsplit("-", 1)[0]: request for rid, request in requests.items()}


def free_blocks(llm: Any) -> int:
    return int(vllm_scheduler(llm).kv_cache_manager.block_pool.get_num_free_blocks())


def stored_and_forgotten(llm: Any, batch: list[list[int]]) -> tuple[dict[str, Any], list[Any], int]:
    """``batch`` stored by a pass, then vLLM's prefix cache reset: (the pass, its records, free blocks)."""
    first, records = engine.stored_by(llm, batch)
    assert llm.reset_prefix_cache()
    return first, records, free_blocks(llm)


def land(llm: Any, gets: HeldGets, outputs: dict[str, list[int]]) -> None:
    """Let the held loads go and step until vLLM holds no request (collecting finished ones);
    then kvpipe holds nothing of them either: no load in flight, no staging slot."""
    gets.release()
    step_until(llm, lambda: not engine_requests(llm), outputs)
    assert engine.scheduler(llm).loads_in_flight == 0
    assert engine.worker(llm).gauges().get(STAGING_SLOTS_IN_USE, 0) == 0


def abort_while_loading(llm: Any, batch: list[list[int]], gets: HeldGets) -> tuple[str, int]:
    """Add ``batch``, step until a load is in flight, abort its request: (its id, the free blocks then)."""
    add_requests(llm, batch)
    step_until(llm, gets.reached.is_set, {})
    requests = engine_requests(llm).items()
    (loading,) = [rid for rid, request in requests if request.status.name == "WAITING_FOR_REMOTE_KVS"]
    llm.llm_engine.abort_request([loading])
    for _ in range(3):
        llm.llm_engine.step()
    return loading, free_blocks(llm)


def test_a_request_aborted_while_its_load_is_in_flight_keeps_its_blocks_until_the_load_lands(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = engine.prompts(71, 1)
    first, _, idle = stored_and_forgotten(llm, batch)
    gets = HeldGets(monkeypatch)

    _, while_loading = abort_while_loading(llm, batch, gets)
    land(llm, gets, {})

    assert while_loading < idle  # not handed to another request while the load writes them
    assert free_blocks(llm) == idle
    again = engine.generate(llm, batch)
    assert again["tokens"] == first["tokens"]
    assert again["cached"] == [engine.FULL_HIT]


def test_a_load_that_fails_after_its_request_was_aborted_frees_its_blocks(
    llm: Any, holder: MooncakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = engine.prompts(72, 1)
    first, records, idle = stored_and_forgotten(llm, batch)
    gets = HeldGets(monkeypatch)

    abort_while_loading(llm, batch, gets)
    for key in {record.key for record in records}:
        holder.remove(key, force=True)
    land(llm, gets, {})

    assert free_blocks(llm) == idle
    again = engine.generate(llm, batch)
    assert again["tokens"] == first["tokens"]
    assert again["cached"] == [0]


def test_requests_waiting_on_an_aborted_requests_load_of_their_prefix_load_it_themselves(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = engine.family(73, 3)
    first, _, idle = stored_and_forgotten(llm, batch)
    planned = engine.scheduler(llm).stats["loads_planned"]
    gets = HeldGets(monkeypatch)
    outputs: dict[str, list[int]] = {}

    aborted, _ = abort_while_loading(llm, batch, gets)
    land(llm, gets, outputs)

    others = {f"r{index}": tokens for index, tokens in enumerate(first["tokens"]) if f"r{index}" != aborted}
    assert outputs == others
    # the aborted request's load, then one for the rest
    assert engine.scheduler(llm).stats["loads_planned"] - planned == 2
    assert free_blocks(llm) == idle
