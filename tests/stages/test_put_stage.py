"""``put`` stores records in calls within the buffer budget and reports each record."""

import threading
import time

import anyio
import pytest
from pydantic import ValidationError

from kvpipe.connector.store.memory import Faults, MemoryStore
from kvpipe.pipeline.testing import RecordingEmit, batch_of
from kvpipe.stages import (
    FullChunksStage,
    ProjectedRequest,
    PutParams,
    PutStage,
    split_into_calls,
    storable_groups,
)

from .kv_fixtures import make_kv, make_request
from .save_path import put_params
from .stores import RecordingStore, ScriptedStore, by_first_sight, fake_record


def _stage(store, **params):
    return PutStage(put_params(**params), store)


def _scripted(codes, **kwargs):
    return RecordingStore(ScriptedStore(put=lambda key: codes.get(key, 0), **kwargs))


async def _real_records(kv):
    await FullChunksStage(kv).process(
        ProjectedRequest(make_request(kv, tokens=32), storable_groups(kv)), emit := RecordingEmit()
    )
    (records,) = emit.emitted["out"]
    return records


async def test_a_stored_record_counts_as_put_and_succeeds():
    batch = batch_of([(fake_record("a"),)])

    await _stage(_scripted({})).process_batch(batch)

    assert batch[0].emit.counts["put"] == 1
    assert batch[0].emit.succeeded_units == 1
    assert not batch[0].emit.failures


async def test_already_exists_counts_as_stored():
    kv = make_kv().kv
    store = MemoryStore(faults=Faults(error_rates={"put": {-705: 1.0}}))
    batch = batch_of([await _real_records(kv)])

    await _stage(store).process_batch(batch)

    assert batch[0].emit.counts["existing"] == 2
    assert batch[0].emit.succeeded_units == 2
    assert not batch[0].emit.failures


async def test_no_space_is_counted_as_backpressure_and_fails_the_record():
    batch = batch_of([(fake_record("a"), fake_record("b"))])

    await _stage(_scripted({"a": -200}), backoff_initial_s=0, space_wait_s=0).process_batch(batch)

    emit = batch[0].emit
    assert emit.counts["backpressure"] == 1
    assert emit.counts["failed"] == 1
    assert emit.failures == ["put a: -200 (NO_SPACE)"]
    assert emit.counts["put"] == 1


async def test_a_record_refused_for_space_is_put_once_more_after_the_back_off():
    tries: dict[str, int] = {}

    def full_at_first(key: str) -> int:
        tries[key] = tries.get(key, 0) + 1
        return -200 if tries[key] == 1 else 0

    store = RecordingStore(ScriptedStore(put=full_at_first))
    batch = batch_of([(fake_record("a"), fake_record("b"))])

    await _stage(store, backoff_initial_s=0).process_batch(batch)

    assert store.put_keys == ["a", "b", "a", "b"]
    assert batch[0].emit.counts["put"] == 2
    assert batch[0].emit.counts["backpressure"] == 0


async def test_a_record_refused_for_space_is_tried_again_until_the_space_wait_has_passed():
    tries: dict[str, int] = {}

    def full_for_a_while(key: str) -> int:  # a store whose eviction (or disk offload) lags
        tries[key] = tries.get(key, 0) + 1
        return -200 if tries[key] <= 4 else 0

    store = RecordingStore(ScriptedStore(put=full_for_a_while))
    batch = batch_of([(fake_record("a"),)])

    await _stage(store, backoff_initial_s=0, space_wait_s=60).process_batch(batch)

    assert store.put_keys == ["a"] * 5
    assert batch[0].emit.counts["put"] == 1


async def test_a_record_refused_for_space_once_the_space_wait_has_passed_is_not_tried_again():
    store = _scripted({"a": -200})

    await _stage(store, backoff_initial_s=0, space_wait_s=0).process_batch(
        batch_of([(fake_record("a"), fake_record("b"))])
    )

    assert store.put_keys == ["a", "b", "a"]


async def test_records_refused_for_space_are_tried_again_while_each_try_stores_some_of_them():
    room_at_try = {"a": 2, "b": 3, "c": 4}  # a store evicting room for one object per round
    tries: dict[str, int] = {}

    def one_more_fits_each_round(key: str) -> int:
        tries[key] = tries.get(key, 0) + 1
        return 0 if tries[key] >= room_at_try[key] else -200

    store = RecordingStore(ScriptedStore(put=one_more_fits_each_round))
    batch = batch_of([(fake_record("a"), fake_record("b"), fake_record("c"))])

    await _stage(store, backoff_initial_s=0, space_wait_s=0).process_batch(batch)

    assert store.put_keys == ["a", "b", "c", "a", "b", "c", "b", "c", "c"]
    assert batch[0].emit.counts["put"] == 3


async def test_any_other_code_fails_the_record_naming_key_and_code():
    batch = batch_of([(fake_record("a"),)])

    await _stage(_scripted({"a": -800})).process_batch(batch)

    assert batch[0].emit.failures == ["put a: -800 (TRANSFER_FAILED)"]
    assert batch[0].emit.counts["failed"] == 1
    assert batch[0].emit.counts["backpressure"] == 0


async def test_a_batch_over_the_buffer_budget_is_split_into_calls_that_each_respect_it():
    store = _scripted({})
    records = [fake_record(f"k{i}", buffers=n) for i, n in enumerate([3, 2, 2, 4, 1, 1])]
    batch = batch_of([tuple(records[:3]), tuple(records[3:])])

    await _stage(store, max_buffers_per_call=5).process_batch(batch)

    assert [call.keys for call in store.put_calls] == [["k0", "k1"], ["k2"], ["k3", "k4"], ["k5"]]
    assert all(sum(len(p) for p in call.ptrs) <= 5 for call in store.put_calls)
    assert [entry.emit.counts["put"] for entry in batch] == [3, 3]


def test_split_into_calls_keeps_order_and_fills_each_call_up_to_the_budget():
    records = [fake_record(f"k{i}", buffers=n) for i, n in enumerate([2, 2, 1, 5, 3])]

    calls = split_into_calls(records, max_buffers=5)

    assert [[r.key for r in call] for call in calls] == [["k0", "k1", "k2"], ["k3"], ["k4"]]


async def test_a_record_with_more_buffers_than_the_budget_fails_and_is_never_sent():
    store = _scripted({})
    batch = batch_of([(fake_record("huge", buffers=9), fake_record("ok", buffers=2))])

    await _stage(store, max_buffers_per_call=8).process_batch(batch)

    assert store.put_keys == ["ok"]
    assert batch[0].emit.failures == ["put huge: 9 buffers exceed max_buffers_per_call=8; not sent"]
    assert batch[0].emit.counts == {"failed": 1, "failed_too_large": 1, "put": 1}


async def test_a_key_in_several_entries_is_sent_once_and_is_existing_for_the_later_ones():
    store = _scripted({})
    batch = batch_of([(fake_record("shared"),), (fake_record("shared"), fake_record("own"))])

    await _stage(store).process_batch(batch)

    assert store.put_keys == ["shared", "own"]
    assert [(e.emit.counts["put"], e.emit.counts["existing"]) for e in batch] == [(1, 0), (1, 1)]


async def test_the_parallel_lists_are_built_from_the_records():
    store = _scripted({})
    records = (fake_record("a", buffers=2), fake_record("b", buffers=1))

    await _stage(store).process_batch(batch_of([records]))

    (call,) = store.put_calls
    assert call.keys == ["a", "b"]
    assert call.ptrs == [[b.address for b in r.buffers] for r in records]
    assert call.sizes == [[b.size for b in r.buffers] for r in records]


async def test_every_call_gets_a_fresh_replicate_config():
    store = _scripted({})
    batch = batch_of([(fake_record("a"), fake_record("b"), fake_record("c"))])

    await _stage(store, max_buffers_per_call=1).process_batch(batch)

    configs = [call.config for call in store.put_calls]
    assert len({id(c) for c in configs}) == 3


async def test_group_ids_come_from_the_records_with_empty_for_none():
    store = _scripted({})
    records = (fake_record("a", group_id="g-a"), fake_record("b"), fake_record("c", group_id="g-c"))

    await _stage(store).process_batch(batch_of([records]))

    assert store.put_calls[0].group_ids == ["g-a", "", "g-c"]


async def test_group_ids_are_not_set_when_no_record_has_one():
    store = _scripted({})

    await _stage(store).process_batch(batch_of([(fake_record("a"),)]))

    assert store.put_calls[0].group_ids is None


async def test_group_ids_are_not_set_when_the_store_has_none():
    store = _scripted({}, supports_group_ids=False)

    await _stage(store).process_batch(batch_of([(fake_record("a", group_id="g-a"),)]))

    assert store.put_calls[0].group_ids is None


async def test_a_wrong_length_answer_fails_every_record_of_that_call_only():
    store = _scripted({})
    calls = 0

    def short_first_call(keys, ptrs, sizes, config):
        nonlocal calls
        calls += 1
        return [] if calls == 1 else [0] * len(keys)

    store.inner.batch_put_from_multi_buffers = short_first_call
    batch = batch_of([(fake_record("a"), fake_record("b"))])

    await _stage(store, max_buffers_per_call=1).process_batch(batch)

    assert batch[0].emit.failures == ["put a: store answered 0 results for 1 keys"]
    assert batch[0].emit.counts == {"failed": 1, "failed_store_error": 1, "put": 1}


async def test_after_backpressure_the_next_call_waits_the_backoff():
    sent_at: dict[str, float] = {}

    def put(key):
        sent_at[key] = time.monotonic()
        return -200 if key == "a" else 0

    store = ScriptedStore(put=put)
    batch = batch_of([(fake_record("a"), fake_record("b"))])

    await _stage(store, max_buffers_per_call=1, backoff_initial_s=0.05).process_batch(batch)

    assert sent_at["b"] - sent_at["a"] >= 0.045


@pytest.mark.parametrize(
    "params",
    [
        {"max_buffers_per_call": 0},
        {"backoff_initial_s": -1},
        {"backoff_initial_s": 0.5, "backoff_max_s": 0.1},
        {"max_buffer_per_call": 8},
    ],
)
def test_bad_params_are_refused(params):
    with pytest.raises(ValidationError):
        PutParams(**params)


def test_split_into_calls_keeps_the_objects_of_one_chunk_in_one_call():
    a, b = b"\x01", b"\x02"
    records = [
        fake_record("a0", buffers=2, chunk_hash=a),
        fake_record("b0", buffers=2, chunk_hash=b),
        fake_record("a1", buffers=2, chunk_hash=a),
        fake_record("b1", buffers=2, chunk_hash=b),
    ]

    calls = split_into_calls(records, max_buffers=6)

    assert [[r.key for r in call] for call in calls] == [["a0", "a1"], ["b0", "b1"]]


async def test_under_group_semantics_a_chunk_partly_refused_is_removed_whole():
    inner = ScriptedStore(put=lambda key: -800 if key == "shard1" else 0)
    gid = "vllm-mooncake-store:m@aa"
    chunk = (fake_record("shard0", group_id=gid), fake_record("shard1", group_id=gid))
    other = (fake_record("other", chunk_hash=b"\xbb", group_id="vllm-mooncake-store:m@bb"),)
    batch = batch_of([chunk, other])

    await _stage(RecordingStore(inner)).process_batch(batch)

    assert inner.removed == ["shard0"]
    assert batch[0].emit.counts == {"failed": 2, "failed_rolled_back": 1, "failed_store_error": 1}
    assert batch[1].emit.counts == {"put": 1}


async def test_without_group_ids_a_partly_refused_chunk_keeps_what_was_stored():
    inner = ScriptedStore(put=lambda key: -800 if key == "shard1" else 0)
    batch = batch_of([(fake_record("shard0"), fake_record("shard1"))])

    await _stage(RecordingStore(inner)).process_batch(batch)

    assert inner.removed == []
    assert batch[0].emit.counts == {"put": 1, "failed": 1, "failed_store_error": 1}


async def test_a_key_another_batch_is_putting_is_put_only_after_that_put_and_its_rollback():
    gid = "vllm-mooncake-store:m@aa"
    chunk = (fake_record("shard0", group_id=gid), fake_record("shard1", group_id=gid))
    first_put_may_return = threading.Event()
    log: list[tuple[str, ...]] = []

    class FirstPutRefusesOneShard(ScriptedStore):
        def batch_put_from_multi_buffers(self, keys, ptrs, sizes, config):
            log.append(("put", *keys))
            if len(log) > 1:
                return [0] * len(keys)
            first_put_may_return.wait(30)
            return [0 if key == "shard0" else -800 for key in keys]

        def remove(self, key, *, force=False):
            log.append(("remove", key))
            return 0

    stage = _stage(FirstPutRefusesOneShard())
    stage.thread_limit = 2  # as the save graph's two put workers
    first, second = batch_of([chunk]), batch_of([chunk])
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tasks:
            try:
                tasks.start_soon(stage.process_batch, first)
                while not log:
                    await anyio.sleep(0.001)
                tasks.start_soon(stage.process_batch, second)
                await anyio.wait_all_tasks_blocked()
                assert log == [("put", "shard0", "shard1")]  # the second batch waits
            finally:
                first_put_may_return.set()

    assert log == [("put", "shard0", "shard1"), ("remove", "shard0"), ("put", "shard0", "shard1")]
    assert first[0].emit.counts == {"failed": 2, "failed_rolled_back": 1, "failed_store_error": 1}
    assert second[0].emit.counts == {"put": 2}


async def test_the_rest_of_a_chunk_rolled_back_since_the_filter_asked_is_not_put():
    gid = "vllm-mooncake-store:m@aa"
    shard0, shard1 = fake_record("shard0", group_id=gid), fake_record("shard1", group_id=gid)
    inner = ScriptedStore(put=by_first_sight([0, -200]))  # shard0 stored, shard1 refused: torn
    store = RecordingStore(inner)
    stage = _stage(store, backoff_initial_s=0, backoff_max_s=0)
    await stage.process_batch(batch_of([(shard0, shard1)]))
    assert inner.removed == ["shard0"]
    store.put_calls.clear()

    # filtered before that rollback: shard0 was answered stored, so only shard1 comes
    late = batch_of([(shard1,)])
    await stage.process_batch(late)

    assert store.exist_calls == [["shard0"]]
    assert store.put_calls == []
    assert late[0].emit.counts == {"failed": 1, "failed_rolled_back": 1}


async def test_the_rest_of_a_rolled_back_chunk_is_put_once_its_removed_objects_are_back():
    gid = "vllm-mooncake-store:m@aa"
    shard0, shard1 = fake_record("shard0", group_id=gid), fake_record("shard1", group_id=gid)
    refusals = iter([0, -200])
    inner = ScriptedStore(exist=lambda key: 1, put=lambda key: next(refusals, 0))
    store = RecordingStore(inner)
    stage = _stage(store, backoff_initial_s=0, backoff_max_s=0)
    await stage.process_batch(batch_of([(shard0, shard1)]))
    store.put_calls.clear()

    later = batch_of([(shard1,)])  # shard0 stored again (by another request) meanwhile
    await stage.process_batch(later)

    assert store.exist_calls == [["shard0"]]
    assert store.put_keys == ["shard1"]
    assert later[0].emit.counts == {"put": 1}


class _Shedding:
    """A slow-store throttle that sheds every call."""

    def allow(self) -> bool:
        return False

    def record(self, spent_s: float, nbytes: int) -> None:
        pass


async def test_while_the_throttle_sheds_a_handoffs_objects_are_still_put():
    store = _scripted({})
    stage = _stage(store)
    stage.throttle = _Shedding()  # type: ignore[assignment]
    batch = batch_of([(fake_record("cache"),), (fake_record("handoff", handoff=True),)])

    await stage.process_batch(batch)

    assert [key for call in store.put_calls for key in call.keys] == ["handoff"]
    assert batch[0].emit.counts["throttled"] == 1
    assert batch[1].emit.counts["put"] == 1
