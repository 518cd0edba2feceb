"""A key another put batch stored after the filter answered "absent" for it: settled existing, never resealed.

The race of issue 55: two requests share a prefix; the filter answers for both
before either is put (both absent); the first's put stores the shared chunks and
its seal under the first chunk. Put again by the second, the shared chunks answer
0 and so did its seal under that same first chunk, which kept the first writer's
span: the second's own chunks were stored with no seal naming them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import replace

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.pipeline.testing import RecordingEmit, batch_of
from kvpipe.stages import (
    Code,
    FilterStage,
    FullChunksStage,
    KVCache,
    ProjectedRequest,
    PutStage,
    SaveRequest,
    SavingStore,
    Seal,
    StoreObject,
    fingerprint,
    seal_key,
    storable_groups,
)
from kvpipe.stages.integrity import SEAL_SIZE, key_id
from kvpipe.stages.stored_lately import StoredLately

from .kv_fixtures import make_kv, make_request
from .save_path import put_params
from .stores import RecordingStore, ScriptedStore, fake_record

CHUNKS = 4  # per request; the two share the first SHARED
SHARED = 2


def _requests(kv: KVCache) -> tuple[SaveRequest, SaveRequest]:
    """Two requests of :data:`CHUNKS` chunks in blocks of their own, sharing their first :data:`SHARED`."""
    first = make_request(kv, 16 * CHUNKS, request_id="first", first_block=1)
    second = make_request(kv, 16 * CHUNKS, request_id="second", first_block=1 + CHUNKS)
    return first, replace(second, block_hashes=first.block_hashes[:SHARED] + second.block_hashes[SHARED:])


async def _filtered(kv: KVCache, store: SavingStore, request: SaveRequest) -> tuple[StoreObject, ...]:
    """The request's records the filter finds absent (one batch of its own)."""
    await FullChunksStage(kv).process(ProjectedRequest(request, storable_groups(kv)), made := RecordingEmit())
    (records,) = made.emitted["out"]
    (entry,) = batch = batch_of([records])
    await FilterStage(store).process_batch(batch)
    (absent,) = entry.emit.emitted["out"]
    return absent


async def _put_one_after_the_other(stage: PutStage, *items: tuple[StoreObject, ...]) -> list[RecordingEmit]:
    """Each item put in a batch of its own, in order; each one's job handle."""
    emits = []
    try:
        for item in items:
            (entry,) = batch = batch_of([item])
            await stage.process_batch(batch)
            emits.append(entry.emit)
    finally:  # its seal memory is unregistered: the store outlives the stage
        await stage.stop()
    return emits


def _named_by_no_seal(store: MemoryStore, keys: Iterable[str]) -> list[str]:
    """Those of ``keys`` stored in ``store`` that no seal stored under any of ``keys`` names."""
    keys = list(keys)
    named: set[int] = set()
    buffer = ctypes.create_string_buffer(SEAL_SIZE)
    for key in keys:
        (read,) = store.batch_get_into_multi_buffers([seal_key(key)], [[ctypes.addressof(buffer)]], [[SEAL_SIZE]])
        if read == SEAL_SIZE and (seal := Seal.unpack(buffer.raw)) is not None:
            named.update(entry.key_id for entry in seal.entries)
    return [key for key, there in zip(keys, store.batch_is_exist(keys), strict=True) if there and key_id(key) not in named]


async def test_chunks_a_request_shares_with_one_put_since_its_filter_asked_leave_its_own_chunks_sealed():
    kv = make_kv(num_blocks=16).kv
    store = MemoryStore()
    first, second = [await _filtered(kv, store, request) for request in _requests(kv)]  # both absent
    assert len(first) == len(second) == CHUNKS

    await _put_one_after_the_other(PutStage(put_params(), store, fingerprint=fingerprint(kv)), first, second)

    assert _named_by_no_seal(store, [record.key for record in first + second]) == []


async def test_chunks_another_batch_stored_since_the_filter_asked_are_existing_and_not_put_again():
    kv = make_kv(num_blocks=16).kv
    store = RecordingStore(MemoryStore())
    first, second = [await _filtered(kv, store, request) for request in _requests(kv)]
    stage = PutStage(put_params(), store, fingerprint=fingerprint(kv))

    _, late = await _put_one_after_the_other(stage, first, second)

    assert (late.counts["existing"], late.counts["put"], late.counts["unsealed"]) == (SHARED, CHUNKS - SHARED, 0)
    assert [key for key in store.put_keys if not key.endswith("@kvpipe-seal")] == [
        record.key for record in first + second[SHARED:]
    ]


async def test_a_key_stored_and_gone_again_since_its_record_was_made_is_put_again():
    store = RecordingStore(ScriptedStore(exist=lambda key: 0))  # asked again: absent (evicted meanwhile)
    record = fake_record("a")

    emits = await _put_one_after_the_other(PutStage(put_params(), store), (record,), (record,))

    assert store.exist_calls == [["a"]]
    assert store.put_keys == ["a", "a"]
    assert [emit.counts["put"] for emit in emits] == [1, 1]


async def test_a_key_stored_since_its_record_was_made_that_the_store_cannot_answer_for_fails():
    store = RecordingStore(ScriptedStore(exist=lambda key: Code.RPC_TIMEOUT))
    record = fake_record("a")

    _, late = await _put_one_after_the_other(PutStage(put_params(), store), (record,), (record,))

    assert store.put_keys == ["a"]
    assert late.counts["failed_store_error"] == 1
    assert late.failures == ["exist a: -901 (RPC_TIMEOUT)"]


async def test_a_record_made_after_its_key_was_stored_is_put_without_asking():
    """Its filter asked after that put: "absent" then means the object went since."""
    store = RecordingStore(ScriptedStore())
    stage = PutStage(put_params(), store)
    await stage.process_batch(batch_of([(fake_record("a"),)]))

    await stage.process_batch(batch_of([(fake_record("a"),)]))  # made after the first put returned

    assert store.exist_calls == []
    assert store.put_keys == ["a", "a"]


def _holders(*records: StoreObject) -> dict[str, list[tuple[None, StoreObject]]]:
    return {record.key: [(None, record)] for record in records}


def test_a_key_is_stale_for_a_record_made_before_it_was_stored():
    now = [100.0]
    memory = StoredLately(memory_s=5.0, clock=lambda: now[0])
    before, after = replace(fake_record("a"), made_at=99.0), replace(fake_record("a"), made_at=101.0)
    now[0] = 100.0
    memory.note(["a"])

    assert memory.stale(_holders(before)) == ["a"]
    assert memory.stale(_holders(after)) == []


def test_a_record_older_than_the_memory_is_stale_whatever_it_remembers():
    now = [100.0]
    memory = StoredLately(memory_s=5.0, clock=lambda: now[0])

    assert memory.stale(_holders(replace(fake_record("a"), made_at=94.0))) == ["a"]
    assert memory.stale(_holders(replace(fake_record("b"), made_at=96.0))) == []


def test_keys_stored_longer_ago_than_the_memory_are_forgotten():
    now = [100.0]
    memory = StoredLately(memory_s=5.0, clock=lambda: now[0])
    memory.note(["old"])
    now[0] = 104.0
    memory.note(["new"])
    now[0] = 105.5

    memory.note(["newest"])

    assert len(memory) == 2
