"""Past its job's deadline a record is never sent: the store-calling stages fail it at once."""

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.pipeline.testing import batch_of
from kvpipe.stages import FilterStage, LoadParams, LoadRequest, LoadStage, PutStage

from .kv_fixtures import FULL, make_kv, make_request
from .save_path import put_params, run_save_path
from .stores import RecordingStore, ScriptedStore, fake_record


def _expire(batch, *indexes):
    for index in indexes:
        batch[index].emit.expired = True
    return batch


async def test_filter_asks_only_about_records_of_jobs_within_their_deadline():
    store = RecordingStore(ScriptedStore())
    batch = _expire(batch_of([(fake_record("late"),), (fake_record("on-time"),)]), 0)

    await FilterStage(store).process_batch(batch)

    assert store.exist_calls == [["on-time"]]
    assert batch[0].emit.counts["failed"] == 1
    assert batch[0].emit.failures == ["exist late: the job's deadline passed; not sent"]
    assert batch[1].emit.emitted["out"] == [(batch[1].item[0],)]


async def test_put_sends_only_records_of_jobs_within_their_deadline():
    store = RecordingStore(ScriptedStore())
    batch = _expire(batch_of([(fake_record("late"),), (fake_record("on-time"),)]), 0)

    await PutStage(put_params(), store).process_batch(batch)

    assert store.put_keys == ["on-time"]
    assert (batch[0].emit.counts["failed"], batch[1].emit.counts["put"]) == (1, 1)


async def test_a_load_past_its_deadline_is_a_miss_its_blocks_reported_failed():
    source = make_kv([FULL], shards=1, seed=0)
    store = MemoryStore()
    saved = make_request(source.kv, 32)
    await run_save_path(source.kv, store, [saved])
    target = make_kv([FULL], shards=1, seed=1)
    failed: dict[str, frozenset[int]] = {}
    request = LoadRequest("late", saved.block_hashes, ((7, 8),), 0, 32)
    stage = LoadStage(LoadParams(), target.kv, store, lambda request, ids: failed.setdefault(request.request_id, ids))

    await stage.process_batch(batch := _expire(batch_of([request]), 0))

    assert failed == {"late": frozenset({7, 8})}
    assert batch[0].emit.counts["loaded"] == 0 and target.block_bytes(0, 0, 7) != source.block_bytes(0, 0, 1)


async def test_a_job_whose_deadline_passes_during_an_earlier_call_of_the_batch_is_not_sent():
    batch = batch_of([(fake_record("first"),), (fake_record("second"),)])

    def put(key: str) -> int:
        batch[1].emit.expired = True  # the first call took the second job past its deadline
        return 0

    store = RecordingStore(ScriptedStore(put=put))
    await PutStage(put_params(max_buffers_per_call=1), store).process_batch(batch)

    assert store.put_keys == ["first"]
    assert batch[1].emit.failures == ["put second: the job's deadline passed; not sent"]


async def test_a_put_refused_for_space_is_not_tried_again_once_its_job_is_past_its_deadline():
    batch = batch_of([(fake_record("a"),)])

    def full(key: str) -> int:
        batch[0].emit.expired = True  # the refused call took the job past its deadline
        return -200

    store = RecordingStore(ScriptedStore(put=full))
    await PutStage(put_params(backoff_initial_s=0), store).process_batch(batch)

    assert store.put_keys == ["a"]
    assert batch[0].emit.failures == ["put a: -200 (NO_SPACE)"]
