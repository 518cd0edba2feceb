"""KV events: BlockStored once every rank stored a chunk, BlockRemoved when a load finds it gone.

The rules first (workers' reports, the scheduler's announcements), then a real
engine publishing through vLLM's own ZMQ publisher, read back from its replay endpoint and checked
against what the store holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvpipe.connector.engines.launch import close_llm, kvpipe_transfer, vllm_scheduler
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.connector.vllm.events import ChunkAnnouncer, ChunkReporter
from kvpipe.stages import (
    GroupKind,
    GroupSpec,
    LoadRequest,
    ObjectStatus,
    SaveRequest,
    StoreGroup,
    StoreObject,
)
from kvpipe.stages.chunks import chunks_to_save

from . import engine
from .replay import Replayer, kvpipe_events

BS = 4
ATTENTION = StoreGroup(0, 0, GroupSpec(GroupKind.FULL_ATTENTION, BS))
HASHES = tuple(bytes([i]) * 32 for i in range(1, 4))  # three 4-token blocks
TOKENS = list(range(100, 112))
RANKS = [(0, 0), (1, 0)]


def request(tokens: list[int] = TOKENS) -> Any:
    return SimpleNamespace(all_token_ids=tokens, lora_request=None)


def save(computed: int = 12) -> SaveRequest:
    return SaveRequest("r", HASHES, ((7, 8, 9),), computed)


POOL = "vllm-mooncake-store:tiny-llama"


def expect_save(announce: ChunkAnnouncer) -> None:
    """The scheduler has planned :func:`save` of :func:`request`."""
    planned = save()
    announce.expect(request(), planned, chunks_to_save(planned, [ATTENTION], BS))


def announcer(limit: int = 100) -> ChunkAnnouncer:
    return ChunkAnnouncer([ATTENTION], BS, RANKS, POOL, limit=limit)


def test_a_chunk_is_announced_once_every_rank_reported_it_stored() -> None:
    announce = announcer()
    expect_save(announce)
    announce.reported([(0, 0, HASHES[0], True)])
    assert announce.take() == []
    announce.reported([(1, 0, HASHES[0], True)])
    [event] = announce.take()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [maybe_convert_block_hash(HASHES[0])]
    assert event.parent_block_hash is None and event.token_ids == TOKENS[:4] and event.block_size == BS
    assert event.medium == MEDIUM_CPU and event.group_idx == 0


def test_a_stored_chunk_belongs_to_the_shared_pool_not_to_the_engine() -> None:
    announce = announcer()
    expect_save(announce)
    announce.reported([(rank, pp, HASHES[0], True) for rank, pp in RANKS])
    [event] = announce.take()
    assert event.ownership == POOL  # a router files it at its external tier, not as the writer's own


def test_a_removed_chunk_leaves_the_shared_pool() -> None:
    announce = announcer()
    announce.load_failed(LoadRequest("r", HASHES, ((7, 8, 9),), 0, 12), {8})
    [event] = announce.take()
    assert event.ownership == POOL


def test_an_announced_chunk_names_its_parent_and_its_own_tokens() -> None:
    announce = announcer()
    expect_save(announce)
    announce.reported([(rank, pp, HASHES[1], True) for rank, pp in RANKS])
    [event] = announce.take()
    assert event.parent_block_hash == maybe_convert_block_hash(HASHES[0])
    assert event.token_ids == TOKENS[4:8]


def test_a_chunk_one_rank_failed_is_never_announced() -> None:
    announce = announcer()
    expect_save(announce)
    announce.reported([(0, 0, HASHES[2], False), (1, 0, HASHES[2], True)])
    assert announce.take() == []


def test_past_the_pending_limit_the_oldest_chunks_are_given_up() -> None:
    announce = announcer(limit=2)
    expect_save(announce)  # three chunks
    assert announce.given_up == 1
    announce.reported([(rank, pp, HASHES[0], True) for rank, pp in RANKS])
    assert announce.take() == []


def test_a_reset_forgets_what_was_planned_before_it() -> None:
    announce = announcer()
    expect_save(announce)
    announce.forget()
    announce.reported([(rank, pp, HASHES[0], True) for rank, pp in RANKS])
    assert announce.take() == []


def test_a_failed_load_removes_the_chunks_of_its_failed_blocks() -> None:
    announce = announcer()
    announce.load_failed(LoadRequest("r", HASHES, ((7, 8, 9),), 0, 12), {8})
    [event] = announce.take()
    assert isinstance(event, BlockRemoved)
    assert event.block_hashes == [maybe_convert_block_hash(HASHES[1])]
    assert event.medium == MEDIUM_CPU and event.group_idx == 0


def test_a_failed_load_of_unknown_blocks_removes_every_chunk_of_its_range() -> None:
    announce = announcer()
    announce.load_failed(LoadRequest("r", HASHES, ((7, 8, 9),), 4, 12), None)
    [event] = announce.take()
    assert event.block_hashes == [maybe_convert_block_hash(h) for h in HASHES[1:]]


def record(chunk_hash: bytes, store_group: int = 0) -> StoreObject:
    return StoreObject(f"k{store_group}-{chunk_hash.hex()}", chunk_hash, store_group, (), request_id="r")


def test_a_rank_reports_a_chunk_stored_when_each_object_was_put_or_existed() -> None:
    reporter = ChunkReporter((1, 0))
    reporter.planned(5, "r", chunks_to_save(save(8), [ATTENTION], BS))
    reporter.observed(record(HASHES[0]), ObjectStatus.PUT)
    reporter.observed(record(HASHES[1]), ObjectStatus.EXISTING)
    reporter.ended(5)
    assert reporter.take() == [(1, 0, HASHES[0], True), (1, 0, HASHES[1], True)]


def test_a_rank_reports_a_chunk_failed_when_an_object_failed_or_never_got_a_status() -> None:
    reporter = ChunkReporter((0, 0))
    reporter.planned(5, "r", chunks_to_save(save(8), [ATTENTION], BS))
    reporter.observed(record(HASHES[0]), ObjectStatus.FAILED)
    reporter.ended(5)  # HASHES[1] never told: its job ended past its deadline, say
    assert reporter.take() == [(0, 0, HASHES[0], False), (0, 0, HASHES[1], False)]


def test_a_save_dropped_for_want_of_staging_reports_its_chunks_not_stored() -> None:
    reporter = ChunkReporter((0, 0))
    reporter.dropped(chunks_to_save(save(8), [ATTENTION], BS))
    assert sorted(reporter.take()) == [(0, 0, HASHES[0], False), (0, 0, HASHES[1], False)]


# -- a real engine, through vLLM's publisher ------------------------------------------------


@pytest.fixture(scope="module")
def published(
    store_section: dict[str, Any], holder: MooncakeStore, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """An engine with KV events on stores prompts 52; two chunks go; after a reset it looks them up again."""
    from vllm.config import KVEventsConfig

    folder = Path(tmp_path_factory.mktemp("events"))
    events_config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{folder / 'pub'}",
        replay_endpoint=f"ipc://{folder / 'replay'}",
    )
    transfer = kvpipe_transfer({"store": store_section}, load_failure_policy="recompute")
    llm = engine.make_llm(transfer, kv_events_config=events_config)
    replayer = Replayer(str(events_config.replay_endpoint))

    def so_far() -> list[Any]:
        publisher._event_queue.join()  # every batch handed to it is published, and in its replay buffer
        return replayer.replay()

    publisher = vllm_scheduler(llm).kv_event_publisher
    try:
        worker = engine.worker(llm)
        prompts = engine.prompts(52)
        engine.generate(llm, prompts)
        assert worker.drain(10.0)
        engine.generate(llm, [[1, 2, 3]])  # steps that carry the last reports
        stored = so_far()
        put = [r for r, status in worker.observed if status is ObjectStatus.PUT]
        gone = [r for r in put if r.chunk_hash in {p.chunk_hash for p in put[:2]}]
        for r in gone:
            assert holder.remove(r.key, force=True) == 0
        llm.reset_prefix_cache()
        engine.generate(llm, prompts)
        removed = so_far()
        yield {"stored": stored, "put": put, "gone": gone, "removed": removed}
    finally:
        replayer.close()
        close_llm(llm)


def test_every_chunk_the_engine_stored_is_announced_once(published: dict[str, Any]) -> None:
    announced = [h for e in kvpipe_events(published["stored"], BlockStored) for h in e.block_hashes]
    assert sorted(announced) == sorted(maybe_convert_block_hash(r.chunk_hash) for r in published["put"])
    assert len(announced) == 2 * engine.FULL_HIT // engine.BLOCK


def test_an_announced_chunk_is_in_the_store_under_its_key(
    published: dict[str, Any], holder: MooncakeStore
) -> None:
    by_hash = {maybe_convert_block_hash(r.chunk_hash): r.key for r in published["put"]}
    announced = [by_hash[h] for e in kvpipe_events(published["stored"], BlockStored) for h in e.block_hashes]
    assert holder.batch_is_exist(announced) == [1] * len(announced)


def test_every_announced_chunk_belongs_to_the_deployments_pool(published: dict[str, Any]) -> None:
    events = kvpipe_events(published["stored"], BlockStored) + kvpipe_events(published["removed"], BlockRemoved)
    assert {event.ownership for event in events} == {f"vllm-mooncake-store:{engine.MODEL_DIR.name}"}


def test_an_announced_chunk_carries_the_prompt_tokens_it_holds(published: dict[str, Any]) -> None:
    prompts = engine.prompts(52)
    for event in kvpipe_events(published["stored"], BlockStored):
        assert event.block_size == engine.BLOCK and event.group_idx == 0
        assert any(
            event.token_ids == prompt[i : i + engine.BLOCK]
            for prompt in prompts
            for i in range(0, 512, engine.BLOCK)
        )


def test_a_lookup_that_finds_announced_chunks_gone_removes_them(published: dict[str, Any]) -> None:
    removed = [h for e in kvpipe_events(published["removed"], BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(maybe_convert_block_hash(r.chunk_hash) for r in published["gone"])


def test_a_lookup_that_finds_an_announced_chunk_absent_removes_it_once() -> None:
    announce = announcer()
    expect_save(announce)
    announce.reported([(rank, pp, HASHES[0], True) for rank, pp in RANKS])
    announce.take()
    announce.found_absent([HASHES[0], HASHES[2]])  # HASHES[2] was never announced
    announce.found_absent([HASHES[0]])
    [event] = announce.take()
    assert isinstance(event, BlockRemoved) and event.block_hashes == [maybe_convert_block_hash(HASHES[0])]
