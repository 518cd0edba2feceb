"""``filter`` asks the store once per batch and forwards only what it does not have."""

import pytest

from kvpipe.connector.store.memory import Faults, MemoryStore
from kvpipe.pipeline import Outcome, Pipeline
from kvpipe.pipeline.testing import batch_of
from kvpipe.stages import FilterStage, default_save_graph

from .kv_fixtures import make_kv, make_request
from .stores import RecordingStore, ScriptedStore, fake_record


def _store(answers):
    return RecordingStore(ScriptedStore(exist=lambda key: answers[key]))


async def test_one_exist_call_answers_every_record_of_every_entry():
    store = _store({"a": 0, "b": 0, "c": 0})
    batch = batch_of([(fake_record("a"), fake_record("b")), (fake_record("c"),)])

    await FilterStage(store).process_batch(batch)

    assert store.exist_calls == [["a", "b", "c"]]
    assert [entry.emit.emitted["out"] for entry in batch] == [
        [(fake_record("a"), fake_record("b"))],
        [(fake_record("c"),)],
    ]


async def test_existing_records_are_not_forwarded_and_are_counted():
    batch = batch_of([(fake_record("a"), fake_record("b"))])

    await FilterStage(_store({"a": 1, "b": 0})).process_batch(batch)

    emit = batch[0].emit
    assert emit.emitted["out"] == [(fake_record("b"),)]
    assert emit.counts["existing"] == 1
    assert emit.succeeded_units == 1


async def test_an_error_code_fails_the_record_and_is_not_taken_as_missing():
    batch = batch_of([(fake_record("a"), fake_record("b"))])

    await FilterStage(_store({"a": -900, "b": 0})).process_batch(batch)

    emit = batch[0].emit
    assert emit.emitted["out"] == [(fake_record("b"),)]
    assert emit.failures == ["exist a: -900 (RPC_FAILED)"]
    assert emit.counts["failed"] == 1


async def test_an_entry_whose_records_all_exist_is_dropped():
    batch = batch_of([(fake_record("a"), fake_record("b")), (fake_record("c"),)])

    await FilterStage(_store({"a": 1, "b": 1, "c": 0})).process_batch(batch)

    assert batch[0].emit.dropped == ["no object left to put"]
    assert not batch[0].emit.emitted
    assert batch[1].emit.emitted["out"] == [(fake_record("c"),)]


async def test_an_entry_left_with_nothing_to_put_because_of_failures_is_not_dropped():
    batch = batch_of([(fake_record("a"), fake_record("b"))])

    await FilterStage(_store({"a": 1, "b": -901})).process_batch(batch)

    assert (batch[0].emit.dropped, batch[0].emit.emitted["out"]) == ([], [])
    assert batch[0].emit.counts == {"existing": 1, "failed": 1, "failed_store_error": 1}


async def test_a_key_shared_by_two_requests_is_asked_once_and_put_once():
    """Two puts of one chunk would race in the put stage's workers: the first request puts it."""
    store = _store({"shared": 0, "own": 1})
    batch = batch_of([(fake_record("shared"),), (fake_record("shared"), fake_record("own"))])

    await FilterStage(store).process_batch(batch)

    assert store.exist_calls == [["shared", "own"]]
    assert batch[0].emit.emitted["out"] == [(fake_record("shared"),)]
    assert not batch[1].emit.emitted and batch[1].emit.dropped


async def test_a_wrong_length_answer_fails_every_record_of_the_batch():
    store = ScriptedStore()
    store.batch_is_exist = lambda keys: [0] * (len(keys) - 1)
    batch = batch_of([(fake_record("a"), fake_record("b")), (fake_record("c"),)])

    await FilterStage(store).process_batch(batch)

    assert [entry.emit.failures for entry in batch] == [
        ["exist a: store answered 2 results for 3 keys", "exist b: store answered 2 results for 3 keys"],
        ["exist c: store answered 2 results for 3 keys"],
    ]
    assert all(not entry.emit.dropped and not entry.emit.emitted for entry in batch)


async def test_a_save_whose_every_exist_failed_ends_failed_not_partial():
    fixture = make_kv()
    store = MemoryStore(faults=Faults(outage="down"))
    async with Pipeline(default_save_graph(fixture.kv, store)) as pipeline:
        job = await pipeline.submit(make_request(fixture.kv, 32))
    assert job.outcome is Outcome.FAILED


async def test_a_store_call_that_raises_fails_every_record_instead_of_the_pipeline():
    store = ScriptedStore()

    def broken(keys):
        raise RuntimeError("connection reset")

    store.batch_is_exist = broken
    batch = batch_of([(fake_record("a"),)])

    await FilterStage(store).process_batch(batch)

    assert batch[0].emit.failures == ["exist a: store call raised RuntimeError: connection reset"]
    assert batch[0].emit.counts["failed"] == 1


async def test_a_batch_without_records_asks_nothing():
    store = _store({})
    batch = batch_of([()])

    await FilterStage(store).process_batch(batch)

    assert store.exist_calls == []
    assert batch[0].emit.dropped == ["no object left to put"]


@pytest.mark.parametrize("answer", [2, -1])
async def test_any_answer_other_than_1_or_0_is_a_failure(answer):
    batch = batch_of([(fake_record("a"),)])

    await FilterStage(_store({"a": answer})).process_batch(batch)

    assert batch[0].emit.counts["failed"] == 1
