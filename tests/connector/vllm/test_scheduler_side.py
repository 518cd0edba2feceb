"""The scheduler side's rules, driven as vLLM's scheduler drives them, on the memory store (no engine).

Requests, block tables and scheduler outputs are the few fields of vLLM's objects
the scheduler side reads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.connector.vllm.engine_cache import partial_hit_alignment
from kvpipe.connector.vllm.messages import KVPipeKVEvents
from kvpipe.connector.vllm.scheduler import FAILED_CHUNK_TTL_S, SchedulerSide
from kvpipe.connector.vllm.settings import settings_from
from kvpipe.stages import GroupKind, GroupSpec, object_key

from ...stages.clock import Clock
from ...stages.kv_fixtures import chain_hashes
from .caches import engine_cache

BLOCK = 16
PROMPT = 4 * BLOCK + 5  # four whole chunks, then five tokens


@dataclass
class Request:
    """The fields of vLLM's Request the scheduler side reads."""

    request_id: str
    block_hashes: tuple[bytes, ...]
    num_tokens: int = PROMPT
    num_prompt_tokens: int = PROMPT
    num_computed_tokens: int = 0


@dataclass
class Harness:
    side: SchedulerSide
    store: MemoryStore
    clock: Clock
    hashes: tuple[bytes, ...] = field(default_factory=lambda: chain_hashes(PROMPT // BLOCK, salt="shared"))

    def request(self, rid: str) -> Request:
        request = Request(rid, self.hashes)
        self.side.on_new_request(request)
        return request

    def store_chunks(self, count: int, group: int = 0) -> list[str]:
        """Store the first ``count`` chunks of the shared prefix (one byte each: a lookup asks only existence)."""
        return self.store_objects(self.hashes[:count], group)

    def store_objects(self, chunk_hashes: Sequence[bytes], group: int = 0) -> list[str]:
        """Store ``group``'s objects of these chunks, one byte each."""
        keys = [object_key(self.side.cache.namespace(0), group, h) for h in chunk_hashes]
        value = bytearray(1)
        address = ctypes.addressof((ctypes.c_char * 1).from_buffer(value))
        assert self.store.register_buffer(address, 1) == 0
        codes = self.store.batch_put_from(
            keys, [address] * len(keys), [1] * len(keys), self.store.new_replicate_config()
        )
        assert codes == [0] * len(keys)
        self.store.unregister_buffer(address)
        return keys

    def admit(self, request: Request, local: int = 0) -> int | None:
        """vLLM's admission of one waiting request: lookup, then allocation with what it returned."""
        new, is_async = self.side.get_num_new_matched_tokens(request, local)
        if new is None:
            return None
        blocks = SimpleNamespace(get_block_ids=lambda: ([10 + i for i in range(PROMPT // BLOCK + 1)],))
        self.side.update_state_after_alloc(request, blocks, new)
        return new

    def step(self, scheduled: dict[str, int] | None = None, finished: tuple[str, ...] = ()) -> Any:
        output = SimpleNamespace(
            finished_req_ids=set(finished),
            scheduled_new_reqs=[],
            num_scheduled_tokens=scheduled or {},
            kv_connector_block_state=None,
        )
        return self.side.build_connector_meta(output)

    def loads_ended(
        self, finished: set[str], failed: set[str] = frozenset(), blocks: set[int] = frozenset()
    ) -> None:
        self.side.update_connector_output(
            SimpleNamespace(
                finished_recving=finished,
                failed_recving=set(failed),
                invalid_block_ids=set(blocks),
                kv_cache_events=None,
            )
        )

    def saves_reported(self, count: int, stored: bool = True) -> None:
        """The worker's word on the first ``count`` chunks of the shared prefix (one rank puts)."""
        reports = KVPipeKVEvents([(0, 0, chunk_hash, stored) for chunk_hash in self.hashes[:count]])
        self.side.update_connector_output(
            SimpleNamespace(
                finished_recving=set(), failed_recving=set(), invalid_block_ids=set(), kv_cache_events=reports
            )
        )


def make_harness(**settings: Any) -> Harness:
    store = MemoryStore(1 << 20)
    clock = Clock()
    cache = settings.pop("cache", None) or engine_cache()
    side = SchedulerSide(cache, settings_from({"store": {"kind": "memory"}, **settings}), store, clock)
    return Harness(side, store, clock)


@pytest.fixture
def harness() -> Harness:
    """Async loads always (the protocol itself; the idle rule has its own tests below)."""
    return make_harness(load_sync_when_idle=False)


def test_an_async_hit_is_loaded_asynchronously_and_goes_out_in_the_same_step(harness: Harness) -> None:
    harness.store_chunks(4)
    request = harness.request("a")
    assert harness.side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, True)
    harness.admit(request)
    meta = harness.step()  # the loading request is not scheduled in this step
    assert [(load.request_id, load.start_tokens, load.end_tokens) for load in meta.loads] == [("a", 0, 64)]
    assert harness.step().loads == []  # once


def test_a_request_whose_prefix_another_is_loading_asks_again_later(harness: Harness) -> None:
    harness.store_chunks(4)
    first, second = harness.request("a"), harness.request("b")
    assert harness.admit(first) == 4 * BLOCK
    harness.step()
    assert harness.side.get_num_new_matched_tokens(second, 0) == (None, False)
    harness.loads_ended({"a"})
    # a's blocks are in vLLM's prefix cache now: b's local hit covers the prefix
    assert harness.side.get_num_new_matched_tokens(second, 4 * BLOCK) == (0, False)
    assert harness.side.stats["loads_planned"] == 1
    assert harness.side.stats["lookups_deferred"] == 1


def test_a_request_that_waited_for_another_s_load_and_hit_locally_counts_a_load_spared(
    harness: Harness,
) -> None:
    harness.store_chunks(4)
    first, second = harness.request("a"), harness.request("b")
    harness.admit(first)
    harness.step()
    assert harness.side.get_num_new_matched_tokens(second, 0) == (None, False)
    harness.loads_ended({"a"})
    assert harness.side.get_num_new_matched_tokens(second, 4 * BLOCK) == (0, False)
    harness.side.update_state_after_alloc(second, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    assert harness.side.stats["loads_spared"] == 1


def test_a_request_that_never_waited_spares_no_load(harness: Harness) -> None:
    harness.store_chunks(4)
    request = harness.request("a")
    assert harness.side.get_num_new_matched_tokens(request, 4 * BLOCK) == (0, False)
    harness.side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    assert harness.side.stats["loads_spared"] == 0


def test_a_request_may_load_what_lies_past_another_requests_load(harness: Harness) -> None:
    harness.store_chunks(2)
    first = harness.request("a")
    harness.admit(first)
    harness.step()
    harness.store_chunks(4)
    harness.step()  # a new step asks the store again
    second = harness.request("b")
    assert harness.side.get_num_new_matched_tokens(second, 0) == (None, False)  # chunks 0-1 are a's
    harness.loads_ended({"a"})
    assert harness.side.get_num_new_matched_tokens(second, 2 * BLOCK) == (2 * BLOCK, True)


def test_a_request_still_waiting_is_answered_from_the_store_as_it_is_at_each_step(harness: Harness) -> None:
    request = harness.request("a")
    assert harness.side.get_num_new_matched_tokens(request, 0) == (0, False)
    harness.store_chunks(4)
    harness.step()

    assert harness.side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, True)


def test_a_waiting_request_whose_hashes_grew_is_looked_up_over_all_of_them(harness: Harness) -> None:
    harness.store_chunks(4)
    request = Request("a", harness.hashes[:2], num_tokens=2 * BLOCK + 1)
    harness.side.on_new_request(request)
    assert harness.side.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, True)
    harness.step()
    request.block_hashes, request.num_tokens = harness.hashes, PROMPT

    assert harness.side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, True)


def test_a_hit_stops_at_what_the_worker_s_staging_slots_hold() -> None:
    harness = make_harness(load_sync_when_idle=False, staging_blocks=3)
    harness.store_chunks(4)

    assert harness.side.get_num_new_matched_tokens(harness.request("a"), 0) == (3 * BLOCK, True)


def _two_stored_prompts(harness: Harness) -> tuple[Request, Request]:
    """Two requests of four stored chunks each, of prompts that share nothing."""
    harness.store_chunks(4)
    first = harness.request("a")
    harness.hashes = chain_hashes(PROMPT // BLOCK, salt="other")
    harness.store_chunks(4)
    return first, harness.request("b")


def test_a_hit_stops_at_the_slots_the_loads_planned_before_it_leave() -> None:
    harness = make_harness(load_sync_when_idle=False, staging_blocks=6)
    first, second = _two_stored_prompts(harness)

    assert harness.admit(first) == 4 * BLOCK
    assert harness.side.get_num_new_matched_tokens(second, 0) == (2 * BLOCK, True)


def test_the_slots_of_a_load_count_again_once_it_is_reported_finished() -> None:
    harness = make_harness(load_sync_when_idle=False, staging_blocks=6)
    first, second = _two_stored_prompts(harness)
    harness.admit(first)
    harness.step()
    assert harness.side.get_num_new_matched_tokens(second, 0) == (2 * BLOCK, True)  # still out

    harness.loads_ended({"a"})

    assert harness.side.get_num_new_matched_tokens(second, 0) == (4 * BLOCK, True)


def test_loading_in_place_a_hit_is_not_bounded_by_the_staging_slots() -> None:
    harness = make_harness(load_sync_when_idle=False, staging_blocks=3, load_via_staging=False)
    harness.store_chunks(4)

    assert harness.side.get_num_new_matched_tokens(harness.request("a"), 0) == (4 * BLOCK, True)


def test_a_failed_load_makes_the_next_lookup_of_its_request_a_miss_once(harness: Harness) -> None:
    harness.store_chunks(4)
    request = harness.request("a")
    harness.admit(request)
    harness.step()
    harness.loads_ended({"a"}, failed={"a"})  # the objects were gone at load time
    # vLLM puts the request back to 0 and asks again at once: a miss, not the same load again
    assert harness.side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert harness.side.stats["lookups_missed_after_failed_load"] == 1
    assert harness.side.stats["loads_failed"] == 1


def test_block_level_load_errors_count_as_a_failed_load(harness: Harness) -> None:
    harness.store_chunks(4)
    request = harness.request("a")
    harness.admit(request)
    harness.step()
    harness.loads_ended({"a"}, blocks={10})  # its first block
    assert harness.side.get_num_new_matched_tokens(request, 0) == (0, False)


def test_chunks_whose_load_failed_are_misses_for_other_requests_for_a_while(harness: Harness) -> None:
    harness.store_chunks(4)
    first, second = harness.request("a"), harness.request("b")
    harness.admit(first)
    harness.step()
    assert harness.side.get_num_new_matched_tokens(second, 0) == (None, False)
    harness.loads_ended({"a"}, failed={"a"})
    harness.step()
    assert harness.side.get_num_new_matched_tokens(second, 0) == (0, False)  # not the same doomed load
    harness.clock.now += FAILED_CHUNK_TTL_S
    harness.step()
    assert harness.side.get_num_new_matched_tokens(second, 0) == (4 * BLOCK, True)


def test_with_sync_loads_a_load_goes_out_with_the_step_that_schedules_its_request() -> None:
    side = SchedulerSide(
        engine_cache(),
        settings_from({"store": {"kind": "memory"}, "load_async": False}),
        MemoryStore(1 << 20),
    )
    harness = Harness(side, side.store, Clock())  # type: ignore[arg-type]
    harness.store_chunks(4)
    request = harness.request("a")
    assert side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)
    harness.admit(request)
    assert [load.request_id for load in harness.step(scheduled={"a": PROMPT - 4 * BLOCK}).loads] == ["a"]


def test_on_an_idle_engine_a_hit_loads_before_the_forward_of_the_step_that_schedules_it() -> None:
    idle = make_harness()
    idle.store_chunks(4)
    request = idle.request("a")
    assert idle.admit(request) == 4 * BLOCK
    meta = idle.step(scheduled={"a": PROMPT - 4 * BLOCK})
    assert [load.request_id for load in meta.loads] == ["a"]
    assert meta.sync_loads == {"a"}
    assert idle.side.loads_in_flight == 0
    assert idle.side.stats["loads_sync"] == 1


def test_an_idle_engine_answers_a_hit_as_a_sync_load() -> None:
    idle = make_harness()
    idle.store_chunks(4)
    assert idle.side.get_num_new_matched_tokens(idle.request("a"), 0) == (4 * BLOCK, False)


def test_a_hit_found_while_other_requests_run_loads_asynchronously() -> None:
    busy = make_harness()
    busy.store_chunks(4)
    busy.step(scheduled={"running": 1})
    request = busy.request("a")
    assert busy.side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, True)
    busy.admit(request)
    meta = busy.step(scheduled={"running": 1})
    assert [load.request_id for load in meta.loads] == ["a"] and meta.sync_loads == set()
    assert busy.side.loads_in_flight == 1


def test_the_engine_is_idle_again_once_its_running_requests_have_finished() -> None:
    busy = make_harness()
    busy.store_chunks(4)
    busy.step(scheduled={"running": 1})
    busy.side.request_finished(Request("running", busy.hashes))  # type: ignore[arg-type]
    assert busy.side.get_num_new_matched_tokens(busy.request("a"), 0) == (4 * BLOCK, False)


def test_requests_arriving_together_at_an_idle_engine_all_load_sync() -> None:
    """The first one's allocation does not make the engine busy for the others of its step."""
    idle = make_harness()
    idle.store_chunks(4)
    first = idle.request("a")
    idle.admit(first)
    assert idle.side.get_num_new_matched_tokens(idle.request("b"), 0) == (4 * BLOCK, False)


def test_a_hybrid_model_loads_asynchronously_even_on_an_idle_engine() -> None:
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, BLOCK), GroupSpec(GroupKind.SLIDING_WINDOW, BLOCK))
    hybrid = make_harness(cache=engine_cache(groups=groups))
    hybrid.store_chunks(4, group=0)
    hybrid.store_chunks(4, group=1)
    assert hybrid.side.get_num_new_matched_tokens(hybrid.request("a"), 0) == (4 * BLOCK, True)


def test_with_sync_when_idle_off_an_idle_engine_loads_asynchronously() -> None:
    always = make_harness(load_sync_when_idle=False)
    always.store_chunks(4)
    assert always.side.get_num_new_matched_tokens(always.request("a"), 0) == (4 * BLOCK, True)


def test_a_store_that_cannot_answer_is_a_miss(harness: Harness) -> None:
    harness.store_chunks(4)
    harness.store.close()  # every call now answers -900
    assert harness.side.get_num_new_matched_tokens(harness.request("a"), 0) == (0, False)


def plan_saves(side: SchedulerSide, request: Request, scheduled: int) -> list[Any]:
    table = SimpleNamespace(get_block_ids=lambda rid: (list(range(10)),))
    output = SimpleNamespace(
        finished_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=request.request_id, num_computed_tokens=request.num_computed_tokens)
        ],
        num_scheduled_tokens={request.request_id: scheduled},
        kv_connector_block_state=table,
    )
    return side.build_connector_meta(output).saves


@pytest.mark.parametrize(("save_decode_cache", "saved_chunks"), [(False, 4), (True, 7)])
def test_decode_chunks_are_saved_only_with_save_decode_cache(
    save_decode_cache: bool, saved_chunks: int
) -> None:
    """A 69-token prompt (4 whole chunks) decoded to 112 tokens (7 chunks)."""
    settings = settings_from({"store": {"kind": "memory"}, "save_decode_cache": save_decode_cache})
    side = SchedulerSide(engine_cache(), settings, MemoryStore(1 << 20))
    request = Request("a", chain_hashes(7, salt="a"), num_tokens=7 * BLOCK)
    side.on_new_request(request)
    side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    saves = plan_saves(side, request, PROMPT)
    request.num_computed_tokens = PROMPT
    saves += plan_saves(side, request, 7 * BLOCK - PROMPT)  # the decode steps, as one
    chunks = [i for s in saves for i in range(s.num_saved_tokens // BLOCK, s.num_computed_tokens // BLOCK)]
    assert chunks == list(range(saved_chunks))


def test_with_partial_hits_the_prompts_tail_is_offered_once_on_the_step_that_reaches_it() -> None:
    """Hash blocks of 8 in blocks of 16, a 45-token prompt: the tail ends at 40, inside block 2."""
    groups = (
        GroupSpec(GroupKind.FULL_ATTENTION, BLOCK),
        GroupSpec(GroupKind.MAMBA, BLOCK, mamba_mode="align"),
    )
    cache = engine_cache(groups=groups, hash_block_size=8, hit_alignment=8)
    side = SchedulerSide(cache, settings_from({"store": {"kind": "memory"}}), MemoryStore(1 << 20))
    request = Request("a", chain_hashes(5, salt="a"), num_tokens=45, num_prompt_tokens=45)
    side.on_new_request(request)
    side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([], [])), 0)
    table = SimpleNamespace(get_block_ids=lambda rid: ([1, 2, 3], [4, 5, 6]))
    planned = []
    for scheduled in (32, 8, 5):  # vLLM ends a step at the tail, where the mamba state must be
        output = SimpleNamespace(
            finished_req_ids=set(),
            scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=request.num_computed_tokens)],
            num_scheduled_tokens={"a": scheduled},
            kv_connector_block_state=table,
        )
        planned += [
            (s.num_computed_tokens, s.finished, s.state_end) for s in side.build_connector_meta(output).saves
        ]
        request.num_computed_tokens += scheduled

    assert planned == [(32, False, 32), (40, True, 40)]


def test_a_partial_hit_loads_the_block_it_cuts_from_the_object_the_lookup_found_in_that_block() -> None:
    """Hash blocks of 8 in blocks of 16: the mamba state at 40 and block 2 (tokens 32-48) stored whole
    make a hit of 40 with no tail stored at 40; the load reads block 2 from the block's own object."""
    groups = (
        GroupSpec(GroupKind.FULL_ATTENTION, BLOCK),
        GroupSpec(GroupKind.MAMBA, BLOCK, mamba_mode="align"),
    )
    harness = make_harness(cache=engine_cache(groups=groups, hash_block_size=8, hit_alignment=8))
    hashes = chain_hashes(12, salt="cut")
    harness.store_objects([hashes[1], hashes[3], hashes[5]], group=0)  # blocks 0-2
    harness.store_objects([hashes[4]], group=1)  # the state at 40
    request = Request("a", hashes, num_tokens=100, num_prompt_tokens=100)
    harness.side.on_new_request(request)

    new, _ = harness.side.get_num_new_matched_tokens(request, 0)
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13], [20, 21, 22, 23]))
    harness.side.update_state_after_alloc(request, blocks, new)

    assert new == 40
    assert [(load.end_tokens, load.tail_ends) for load in harness.step().loads] == [(40, ((0, 48),))]


def test_only_an_alignment_below_the_prefix_unit_lets_a_hit_end_inside_a_block() -> None:
    """vLLM's alignment is a whole block where a group keeps hits on its blocks (sliding window):
    then no partial tail is worth storing, as vLLM's connector stores none."""
    window = (
        GroupSpec(GroupKind.SLIDING_WINDOW, 128, sliding_window=256),
        GroupSpec(GroupKind.FULL_ATTENTION, 128),
    )
    hybrid = (GroupSpec(GroupKind.FULL_ATTENTION, 384), GroupSpec(GroupKind.MAMBA, 384, mamba_mode="align"))

    assert partial_hit_alignment(window, 128) is None
    assert partial_hit_alignment(window, None) is None
    assert partial_hit_alignment(hybrid, 128) == 128


def test_a_failed_sync_load_is_counted_and_what_the_engine_recomputes_is_saved_again() -> None:
    """A sync load's blocks failed (e.g. refused by their seals): vLLM recomputes them, kvpipe stores them anew."""
    idle = make_harness()
    idle.store_chunks(4)
    request = idle.request("a")
    assert idle.admit(request) == 4 * BLOCK
    request.num_computed_tokens = 4 * BLOCK  # vLLM's view while the load is planned: loaded = computed
    assert plan_saves(idle.side, request, PROMPT - 4 * BLOCK) == []  # nothing new to save yet

    idle.side.update_connector_output(
        SimpleNamespace(
            finished_recving=set(), failed_recving=set(), invalid_block_ids={10}, kv_cache_events=None
        )
    )
    request.num_computed_tokens = 0  # vLLM recomputes from the first failed block
    saves = plan_saves(idle.side, request, PROMPT)

    assert idle.side.stats["loads_failed"] == 1
    assert [(save.num_saved_tokens, save.num_computed_tokens) for save in saves] == [(0, PROMPT)]


def _first_save_of(side: SchedulerSide, request: Request) -> Any:
    side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    (save,) = plan_saves(side, request, PROMPT)
    return save


def test_a_prompt_asked_for_once_is_saved_unpinned() -> None:
    side = make_harness().side
    request = Request("a", chain_hashes(4, salt="once"))
    side.on_new_request(request)

    assert _first_save_of(side, request).reused_chunks == {}


def test_chunks_a_second_request_asks_for_are_marked_for_a_pin_in_its_save() -> None:
    side = make_harness().side
    shared = chain_hashes(2, salt="system")
    first = Request("a", shared + chain_hashes(2, salt="a"))
    second = Request("b", shared + chain_hashes(2, salt="b"))
    side.on_new_request(first)
    side.on_new_request(second)

    assert _first_save_of(side, second).reused_chunks == dict.fromkeys(shared, 2)


def test_a_request_waiting_when_another_arrives_with_its_prefix_is_saved_pinned() -> None:
    """Counts are taken as requests arrive: the first of two requests saves its prefix pinned too."""
    side = make_harness().side
    shared = chain_hashes(4, salt="system")
    first, second = Request("a", shared), Request("b", shared)
    side.on_new_request(first)
    side.on_new_request(second)

    assert _first_save_of(side, first).reused_chunks == dict.fromkeys(shared, 2)


def test_with_retention_off_nothing_is_marked_for_a_pin() -> None:
    side = make_harness(retention=False).side
    shared = chain_hashes(4, salt="system")
    for rid in ("a", "b"):
        side.on_new_request(Request(rid, shared))

    assert _first_save_of(side, Request("b", shared)).reused_chunks == {}


def test_retention_min_requests_sets_how_many_requests_earn_a_pin() -> None:
    side = make_harness(retention_min_requests=3).side
    shared = chain_hashes(4, salt="system")
    side.on_new_request(Request("a", shared))
    side.on_new_request(second := Request("b", shared))

    assert _first_save_of(side, second).reused_chunks == {}


def test_a_kv_consumer_plans_no_saves() -> None:
    """The decode side of a disaggregated deployment reads what producers stored, as in vLLM's connector."""
    settings = settings_from({"store": {"kind": "memory"}})
    side = SchedulerSide(
        engine_cache(), settings, MemoryStore(1 << 20), saves=settings.saves_for("kv_consumer")
    )
    request = Request("a", chain_hashes(4, salt="consumer"))
    side.on_new_request(request)
    side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    assert plan_saves(side, request, PROMPT) == []


def test_a_kv_consumer_saves_with_save_decode_cache() -> None:
    settings = settings_from({"store": {"kind": "memory"}, "save_decode_cache": True})
    assert settings.saves_for("kv_consumer") and settings_from({}).saves_for("kv_producer")


def test_with_enable_lookup_off_nothing_is_a_hit_and_the_store_is_not_asked() -> None:
    harness = make_harness(enable_lookup=False)
    harness.store_chunks(4)
    assert harness.side.get_num_new_matched_tokens(harness.request("a"), 0) == (0, False)
    assert harness.side.stats["lookup_calls"] == 0


# -- waiting for the engine's own saves ---------------------------------------------------------


def saving_harness(**settings: Any) -> Harness:
    """Request "a" computed the shared prompt and its four chunks' saves are planned, not landed."""
    harness = make_harness(**settings)
    computed = harness.request("a")
    harness.side.update_state_after_alloc(computed, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    assert len(plan_saves(harness.side, computed, PROMPT)) == 1
    return harness


def test_a_request_whose_prefix_the_engine_is_still_saving_asks_again() -> None:
    harness = saving_harness()
    assert harness.side.get_num_new_matched_tokens(harness.request("b"), 0) == (None, False)
    assert harness.side.stats["lookups_waited_for_saves"] == 1


def test_once_the_saves_are_reported_stored_the_waiting_request_hits_them() -> None:
    harness = saving_harness()
    waiting = harness.request("b")
    harness.side.get_num_new_matched_tokens(waiting, 0)
    harness.store_chunks(4)
    harness.step()
    harness.saves_reported(4)
    assert harness.side.get_num_new_matched_tokens(waiting, 0) == (4 * BLOCK, False)


def test_a_chunk_reported_not_stored_is_not_waited_for() -> None:
    harness = saving_harness()
    harness.saves_reported(4, stored=False)
    assert harness.side.get_num_new_matched_tokens(harness.request("b"), 0) == (0, False)


def test_a_save_is_waited_for_at_most_lookup_wait_for_saves_s() -> None:
    harness = saving_harness(lookup_wait_for_saves_s=2.0)
    waiting = harness.request("b")
    harness.clock.now += 1.9
    assert harness.side.get_num_new_matched_tokens(waiting, 0) == (None, False)
    harness.step()
    harness.clock.now += 0.1
    assert harness.side.get_num_new_matched_tokens(waiting, 0) == (0, False)


def test_only_the_chunks_that_would_extend_the_hit_are_waited_for() -> None:
    """The first chunk is stored and reported, the second's save failed: the third and fourth,
    still in flight, cannot extend a hit that stops at the second."""
    harness = saving_harness()
    harness.store_chunks(1)
    harness.saves_reported(1)
    harness.side.update_connector_output(
        SimpleNamespace(
            finished_recving=set(),
            failed_recving=set(),
            invalid_block_ids=set(),
            kv_cache_events=KVPipeKVEvents([(0, 0, harness.hashes[1], False)]),
        )
    )
    assert harness.side.get_num_new_matched_tokens(harness.request("b"), 0)[0] == BLOCK


def test_a_request_whose_engine_holds_the_prefix_does_not_wait() -> None:
    harness = saving_harness()
    assert harness.side.get_num_new_matched_tokens(harness.request("b"), 4 * BLOCK) == (0, False)


def test_with_lookup_wait_for_saves_s_0_a_save_in_flight_is_a_miss() -> None:
    harness = saving_harness(lookup_wait_for_saves_s=0)
    assert harness.side.get_num_new_matched_tokens(harness.request("b"), 0) == (0, False)


def test_after_a_scoped_reset_nothing_in_flight_is_waited_for() -> None:
    harness = saving_harness()
    assert harness.side.reset()
    assert harness.side.get_num_new_matched_tokens(harness.request("b"), 0) == (0, False)
