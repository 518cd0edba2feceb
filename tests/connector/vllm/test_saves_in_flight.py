"""Which chunks a lookup may wait for (planned for saving, not yet reported by every rank that puts, within
the wait), and a real engine whose next pass waits for the saves of the pass before.

The engine test has its module to itself: two in-process engines at once do not share a process well.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvpipe.connector.engines.launch import close_llm, kvpipe_transfer
from kvpipe.connector.vllm.saves_in_flight import SavesInFlight

from ...stages.clock import Clock
from . import engine

RANKS = [(0, 0), (1, 0)]
CHUNK = bytes(range(32))


def test_a_chunk_is_awaited_until_every_rank_that_puts_reports_it_stored() -> None:
    saving = SavesInFlight(RANKS, wait_s=5.0, clock=Clock())
    saving.planned([CHUNK])
    saving.reported([(0, 0, CHUNK, True)])
    assert saving.awaited_among([CHUNK.hex()]) == {CHUNK.hex()}
    saving.reported([(1, 0, CHUNK, True)])
    assert saving.awaited_among([CHUNK.hex()]) == set()


def test_one_rank_reporting_a_chunk_not_stored_ends_its_wait() -> None:
    saving = SavesInFlight(RANKS, wait_s=5.0, clock=Clock())
    saving.planned([CHUNK])
    saving.reported([(1, 0, CHUNK, False)])
    assert saving.awaited_among([CHUNK.hex()]) == set()


def test_a_chunk_planned_again_keeps_its_first_end() -> None:
    clock = Clock()
    saving = SavesInFlight(RANKS, wait_s=5.0, clock=clock)
    saving.planned([CHUNK])
    clock.now = 4.0
    saving.planned([CHUNK])  # another request's save of the same chunk
    clock.now = 5.0
    assert saving.awaited_among([CHUNK.hex()]) == set()


def test_past_its_limit_the_oldest_chunks_are_forgotten() -> None:
    saving = SavesInFlight(RANKS, wait_s=5.0, clock=Clock(), limit=2)
    chunks = [bytes([i]) * 32 for i in range(3)]
    saving.planned(chunks)
    assert saving.awaited_among(chunk.hex() for chunk in chunks) == {chunks[1].hex(), chunks[2].hex()}


def test_a_pass_right_after_the_one_that_stored_waits_for_its_saves_and_loads_them(
    store_section: dict[str, Any], reference: dict[int, list[list[int]]]
) -> None:
    """Pass 1's saves are held at their first store call (the existence check) until pass 2 has been
    told to wait: pass 2, started as pass 1 ends (vLLM's prefix cache reset), waits for the saves
    instead of computing the prompts again, then loads them."""
    batch = engine.prompts(11)  # a seed of its own: nothing of it is stored before
    transfer = kvpipe_transfer(
        {"store": store_section, "lookup_wait_for_saves_s": 60.0}, load_failure_policy="recompute"
    )
    llm = engine.make_llm(transfer)
    released = threading.Event()

    def release_once_a_lookup_waits() -> None:
        deadline = time.monotonic() + 60
        while not engine.scheduler(llm).stats["lookups_waited_for_saves"] and time.monotonic() < deadline:
            time.sleep(0.005)
        released.set()

    try:
        store = engine.worker(llm).store
        ask = store.batch_is_exist

        def held_ask(*args: Any) -> Any:
            released.wait(60)
            return ask(*args)

        store.batch_is_exist = held_ask
        first = engine.generate(llm, batch)
        assert first["cached"] == [0, 0]
        assert engine.worker(llm).stats["saves_submitted"] > 0 and not released.is_set()
        assert llm.reset_prefix_cache()
        threading.Thread(target=release_once_a_lookup_waits, daemon=True).start()
        second = engine.generate(llm, batch)

        assert engine.scheduler(llm).stats["lookups_waited_for_saves"] > 0
        assert second["cached"] == [engine.FULL_HIT, engine.FULL_HIT], repr(
            (dict(engine.worker(llm).stats), dict(engine.scheduler(llm).stats))
        )
        assert first["tokens"] == second["tokens"] == reference[11]
    finally:
        released.set()
        close_llm(llm)
