"""Seals end to end on the stages: what a put seals, what a load makes of it, what lookups ask.

Every fault here is a store object whose bytes are not the bytes its writer put;
none of them may reach the engine as loaded, and each is counted by its verdict.
The request saved here has 3 chunks, put in one call: one seal, anchored at
chunk 0, vouches for all three.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import replace

import pytest
import xxhash

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.pipeline.testing import batch_of
from kvpipe.stages import (
    Code,
    Integrity,
    LoadParams,
    LoadRequest,
    LoadStage,
    LookupPlan,
    LookupRequest,
    Seal,
    SealEntry,
    StoreObject,
    Verdict,
    fingerprint,
    is_seal_key,
    object_key,
    seal_key,
    storable_groups,
)
from kvpipe.stages.integrity import SEAL_SIZE, SEAL_SPAN, Vouch, checksum, judge, key_id, seal_spans

from .kv_fixtures import FULL, make_kv, make_request
from .save_path import run_save_path
from .stores import ScriptedStore

TARGET_BLOCKS = (10, 11, 12)  # where the loading engine put the chunks saved from blocks 1, 2, 3
FLOAT16 = (("dtype", '"torch.float16"'),)
BFLOAT16 = (("dtype", '"torch.bfloat16"'),)


def _kv(seed: int = 0, byte_facts=FLOAT16, num_blocks: int = 16):
    fixture = make_kv([FULL], seed=seed, num_blocks=num_blocks)
    fixture.kv = replace(fixture.kv, byte_facts=byte_facts)
    return fixture


class SealReadsFail(MemoryStore):
    """Every read of a seal fails as a transfer (-800), as from a node cut off by the network."""

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
        results = super().batch_get_into_multi_buffers(keys, ptrs, sizes)
        return [Code.TRANSFER_FAILED if is_seal_key(key) else got for key, got in zip(keys, results, strict=True)]


async def _saved(*, sealed: bool = True, store: MemoryStore | None = None):
    """A source cache, a store holding its 3 chunks (sealed unless told otherwise), the request."""
    source = _kv()
    store = MemoryStore(lease_ttl_s=0) if store is None else store
    saved = make_request(source.kv, 48)
    await run_save_path(source.kv, store, [saved], sealed=sealed)
    return source, store, saved


def _key(fixture, saved, chunk: int) -> str:
    return object_key(fixture.kv.shards[0].namespace, 0, saved.block_hashes[chunk])


def _write(store: MemoryStore, key: str, data: bytes) -> None:
    """Replace ``key``'s object with ``data``, as a foreign or buggy writer would."""
    store.remove(key, force=True)
    buffer = ctypes.create_string_buffer(data, len(data))
    config = store.new_replicate_config()
    assert store.batch_put_from_multi_buffers([key], [[ctypes.addressof(buffer)]], [[len(data)]], config) == [0]


def _read(store: MemoryStore, key: str, size: int) -> bytes | None:
    buffer = ctypes.create_string_buffer(size)
    (result,) = store.batch_get_into_multi_buffers([key], [[ctypes.addressof(buffer)]], [[size]])
    return buffer.raw if result == size else None


async def _load(kv, store, saved, *, threads: int = 1, start: int = 0, **params):
    """Load the request's chunks from token ``start`` into TARGET_BLOCKS: (the job's handle, the failed block ids)."""
    failed: dict[str, frozenset[int]] = {}
    request = LoadRequest("load", saved.block_hashes, (TARGET_BLOCKS,), start, 48)
    (entry,) = batch = batch_of([request])
    stage = LoadStage(LoadParams(**params), kv, store, lambda request, ids: failed.setdefault(request.request_id, ids))
    stage.thread_limit = threads
    try:
        await stage.process_batch(batch)
    finally:  # its seal memory is unregistered: the store outlives the stage
        await stage.stop()
    return entry.emit, failed["load"]


async def test_a_sealed_object_loads_verified_byte_for_byte():
    source, store, saved = await _saved()
    target = _kv(seed=1)

    emit, failed = await _load(target.kv, store, saved)

    assert failed == frozenset()
    assert (emit.counts["loaded"], emit.counts["integrity_verified"]) == (3, 3)
    assert all(target.block_bytes(0, 0, TARGET_BLOCKS[i]) == source.block_bytes(0, 0, 1 + i) for i in range(3))


def _same_size_garbage(original: bytes) -> bytes:
    return os.urandom(len(original))


def _torn(original: bytes) -> bytes:
    half = len(original) // 2
    return original[:half] + os.urandom(len(original) - half)


@pytest.mark.parametrize("damage", [_same_size_garbage, _torn], ids=["overwritten", "torn"])
async def test_an_object_whose_bytes_are_not_as_sealed_fails_its_block_and_is_removed(damage):
    source, store, saved = await _saved()
    key = _key(source, saved, 1)
    _write(store, key, damage(source.block_bytes(0, 0, 2)))

    emit, failed = await _load(_kv(seed=1).kv, store, saved)

    assert failed == {TARGET_BLOCKS[1]}
    assert (emit.counts["loaded"], emit.counts["integrity_corrupt"], emit.counts["failed"]) == (2, 1, 1)
    assert "integrity: corrupt" in str(emit.failures[0])
    anchor_seal = seal_key(_key(source, saved, 0))
    assert store.batch_is_exist([key, anchor_seal]) == [0, 1]  # the seal still vouches for chunks 0 and 2


@pytest.mark.parametrize("threads", [2, 3])
async def test_verdicts_judged_in_several_threads_land_on_their_own_objects(threads):
    source, store, saved = await _saved()
    _write(store, _key(source, saved, 1), _same_size_garbage(source.block_bytes(0, 0, 2)))

    emit, failed = await _load(_kv(seed=1).kv, store, saved, threads=threads)

    assert failed == {TARGET_BLOCKS[1]}
    assert (emit.counts["integrity_verified"], emit.counts["integrity_corrupt"]) == (2, 1)


async def test_a_damaged_seal_fails_every_block_of_its_span_and_goes_with_their_objects():
    source, store, saved = await _saved()
    keys = [_key(source, saved, chunk) for chunk in range(3)]
    _write(store, seal_key(keys[0]), os.urandom(SEAL_SIZE))

    emit, failed = await _load(_kv(seed=1).kv, store, saved)

    assert failed == set(TARGET_BLOCKS) and emit.counts["integrity_corrupt"] == 3
    assert store.batch_is_exist([*keys, seal_key(keys[0])]) == [0, 0, 0, 0]


def _of_version(version: int) -> bytes:
    """A seal's bytes under another format version (an older or newer kvpipe's), magic and size as ours."""
    header = bytearray(SEAL_SIZE)
    header[:8] = b"KVPSEAL\x00"
    header[8:10] = version.to_bytes(2, "little")
    return bytes(header)


#: what another kvpipe may have put under a seal key: another size (1: a 48-byte seal), another version
OTHER_FORMATS = {
    "larger": lambda: os.urandom(2 * SEAL_SIZE),  # read as INVALID_PARAMS
    "smaller": lambda: os.urandom(48),  # read as a failed transfer (-800), so its size is asked
    "version 1": lambda: _of_version(1),
    "version 3": lambda: _of_version(3),
}


@pytest.mark.parametrize("written", OTHER_FORMATS.values(), ids=OTHER_FORMATS.keys())
async def test_a_seal_of_another_format_loads_its_objects_unverified_and_removes_nothing(written):
    """A deployment upgraded in place keeps its hits: another kvpipe's seal says nothing, as a missing one."""
    source, store, saved = await _saved()
    keys = [_key(source, saved, chunk) for chunk in range(3)]
    _write(store, seal_key(keys[0]), written())
    target = _kv(seed=1)

    emit, failed = await _load(target.kv, store, saved)

    assert failed == frozenset() and emit.counts["integrity_unverified"] == 3
    assert target.block_bytes(0, 0, TARGET_BLOCKS[0]) == source.block_bytes(0, 0, 1)
    assert store.batch_is_exist([*keys, seal_key(keys[0])]) == [1, 1, 1, 1]


@pytest.mark.parametrize("written", OTHER_FORMATS.values(), ids=OTHER_FORMATS.keys())
async def test_under_integrity_required_a_seal_of_another_format_is_no_seal(written):
    source, store, saved = await _saved()
    key = _key(source, saved, 0)
    _write(store, seal_key(key), written())

    emit, failed = await _load(_kv(seed=1).kv, store, saved, integrity="required")

    assert failed == set(TARGET_BLOCKS) and emit.counts["integrity_unsealed"] == 3
    assert store.batch_is_exist([key, seal_key(key)]) == [1, 1]


async def test_a_seal_read_that_fails_as_a_transfer_fails_its_blocks_and_removes_nothing():
    """A seal of a seal's size whose read fails (a node cut off) says nothing of the bytes."""
    source, store, saved = await _saved(store=SealReadsFail(lease_ttl_s=0))
    key = _key(source, saved, 0)

    emit, failed = await _load(_kv(seed=1).kv, store, saved)

    assert failed == set(TARGET_BLOCKS) and "a seal: -800" in str(emit.failures[0])
    assert store.batch_is_exist([key, seal_key(key)]) == [1, 1]


async def test_a_seal_anchored_after_an_object_says_nothing_of_it():
    """Garbage under chunk 2's own seal key is no anchor of chunk 0's span: chunk 2 is vouched for."""
    source, store, saved = await _saved()
    _write(store, seal_key(_key(source, saved, 2)), os.urandom(SEAL_SIZE))

    emit, failed = await _load(_kv(seed=1).kv, store, saved, start=16)

    assert failed == frozenset() and emit.counts["integrity_verified"] == 2


async def test_an_object_stored_without_its_seal_is_counted_unsealed():
    source = _kv()
    store = ScriptedStore(put=lambda key: Code.NO_SPACE if is_seal_key(key) else Code.OK)

    run = await run_save_path(source.kv, store, [make_request(source.kv, 48)])

    assert (run.counts["put"], run.counts["unsealed"]) == (3, 3)


async def test_an_object_rolled_back_with_its_torn_chunk_is_not_counted_unsealed():
    """Two ranks, two chunks, the seals refused: rank 1's chunk 1 fails, so rank 0's is removed again."""
    source = make_kv([FULL], shards=2)
    request = make_request(source.kv, 32)
    refused = object_key(source.kv.shards[1].namespace, 0, request.block_hashes[1])

    def code(key: str) -> int:
        return Code.NO_SPACE if is_seal_key(key) else Code.TRANSFER_FAILED if key == refused else Code.OK

    run = await run_save_path(source.kv, ScriptedStore(put=code), [request])

    assert (run.counts["put"], run.counts["failed_rolled_back"], run.counts["unsealed"]) == (2, 1, 2)


async def test_an_object_another_configuration_wrote_is_refused_and_left_to_its_writer():
    source, store, saved = await _saved()  # written by a float16 engine
    bfloat16 = _kv(seed=1, byte_facts=BFLOAT16)

    emit, failed = await _load(bfloat16.kv, store, saved)

    assert failed == set(TARGET_BLOCKS)
    assert (emit.counts["loaded"], emit.counts["integrity_foreign"]) == (0, 3)
    assert all(code == 1 for code in store.batch_is_exist([_key(source, saved, i) for i in range(3)]))


async def test_an_unsealed_object_loads_unverified_under_verify():
    source, store, saved = await _saved(sealed=False)  # as vLLM's connector writes them
    target = _kv(seed=1)

    emit, failed = await _load(target.kv, store, saved, integrity="verify")

    assert failed == frozenset()
    assert (emit.counts["loaded"], emit.counts["integrity_unverified"]) == (3, 3)
    assert target.block_bytes(0, 0, TARGET_BLOCKS[0]) == source.block_bytes(0, 0, 1)


async def test_an_unsealed_object_is_refused_under_required_and_kept():
    source, store, saved = await _saved(sealed=False)

    emit, failed = await _load(_kv(seed=1).kv, store, saved, integrity="required")

    assert failed == set(TARGET_BLOCKS) and emit.counts["integrity_unsealed"] == 3
    assert store.batch_is_exist([_key(source, saved, 0)]) == [1]


async def test_integrity_off_loads_what_is_there_as_before_seals_existed():
    source, store, saved = await _saved()
    key = _key(source, saved, 1)
    garbage = _same_size_garbage(source.block_bytes(0, 0, 2))
    _write(store, key, garbage)
    target = _kv(seed=1)

    emit, failed = await _load(target.kv, store, saved, integrity="off")

    assert failed == frozenset() and emit.counts["loaded"] == 3  # sizes only: the damage goes through
    assert target.block_bytes(0, 0, TARGET_BLOCKS[1]) == garbage
    assert not any(name.startswith("integrity_") for name in emit.counts)


async def test_a_put_seals_its_objects_with_their_checksums_and_fingerprint_under_the_first():
    source, store, saved = await _saved()
    keys = [_key(source, saved, chunk) for chunk in range(3)]

    seal = Seal.unpack(_read(store, seal_key(keys[0]), SEAL_SIZE) or b"")

    data = [source.block_bytes(0, 0, 1 + chunk) for chunk in range(3)]
    entries = tuple(SealEntry(key_id(k), len(d), xxhash.xxh3_64_intdigest(d)) for k, d in zip(keys, data, strict=True))
    assert seal == Seal(fingerprint(source.kv), entries)
    assert store.batch_is_exist([seal_key(keys[1]), seal_key(keys[2])]) == [0, 0]


async def test_a_load_that_starts_after_the_anchor_finds_the_seal_before_its_range():
    """The engine holds chunk 0 itself (its prefix cache) and loads chunks 1 and 2 only."""
    source, store, saved = await _saved()
    target = _kv(seed=1)

    emit, failed = await _load(target.kv, store, saved, start=16)

    assert failed == frozenset() and emit.counts["integrity_verified"] == 2


async def test_a_long_request_is_sealed_in_spans_each_vouching_for_its_own():
    chunks = SEAL_SPAN + 4
    source = _kv(num_blocks=chunks + 2)
    store = MemoryStore(lease_ttl_s=0)
    saved = make_request(source.kv, 16 * chunks)
    await run_save_path(source.kv, store, [saved])
    target = _kv(seed=1, num_blocks=chunks + 2)
    blocks = tuple(range(1, chunks + 1))

    anchors = [seal_key(_key(source, saved, chunk)) for chunk in (0, SEAL_SPAN)]
    assert store.batch_is_exist(anchors) == [1, 1]
    for start in (0, 16 * (SEAL_SPAN - 1), 16 * (SEAL_SPAN + 1)):
        request = LoadRequest("load", saved.block_hashes, (blocks,), start, 16 * chunks)
        (entry,) = batch = batch_of([request])
        stage = LoadStage(LoadParams(), target.kv, store)
        try:
            await stage.process_batch(batch)
        finally:
            await stage.stop()
        assert entry.emit.counts["integrity_verified"] == chunks - start // 16, start


async def test_an_object_put_again_after_a_refusal_is_vouched_for_by_its_own_nearer_seal():
    """Chunk 1 is removed as damaged; the recompute that replaces it need not match the bytes its
    first seal (anchored at chunk 0, which stays) describes: its new seal, anchored at itself, wins."""
    source, store, saved = await _saved()
    _write(store, _key(source, saved, 1), _same_size_garbage(source.block_bytes(0, 0, 2)))
    await _load(_kv(seed=1).kv, store, saved)
    other_bytes = _kv(seed=3)  # another batch shape, another kernel: other last bits

    await run_save_path(other_bytes.kv, store, [saved])
    emit, failed = await _load(_kv(seed=2).kv, store, saved)

    assert failed == frozenset() and emit.counts["integrity_verified"] == 3
    assert store.batch_is_exist([seal_key(_key(source, saved, 1))]) == [1]


async def test_an_object_beside_another_writer_s_seal_costs_one_recompute_then_heals():
    """A put of a key that exists keeps the first value: two writers racing on one chunk,
    or a seal outliving its evicted object, can pair one writer's bytes with another's seal."""
    source, store, saved = await _saved()
    key = _key(source, saved, 0)
    _write(store, key, _same_size_garbage(source.block_bytes(0, 0, 1)))  # the racing writer's bytes

    first, failed = await _load(_kv(seed=1).kv, store, saved)
    await run_save_path(source.kv, store, [saved])  # the engine recomputed the chunk and saves it
    second, refailed = await _load(_kv(seed=2).kv, store, saved)

    assert failed == {TARGET_BLOCKS[0]} and first.counts["integrity_corrupt"] == 1
    assert refailed == frozenset() and second.counts["integrity_verified"] == 1
    assert second.counts["integrity_unverified"] == 2  # their seal was chunk 0's own: it went with it


def _lookup(store, fixture, saved, sealed):
    groups = storable_groups(fixture.kv)
    request = LookupRequest("r", saved.block_hashes, 49)
    plan = LookupPlan(groups, fixture.kv.shards, 16, request, sealed=sealed)
    exists = dict(zip(plan.keys, (code == 1 for code in store.batch_is_exist(list(plan.keys))), strict=True))
    return plan.keys, plan.hit(exists)


async def test_a_lookup_under_required_asks_for_seals_and_misses_a_chunk_no_seal_can_vouch_for():
    source, store, saved = await _saved()
    store.remove(seal_key(_key(source, saved, 0)), force=True)

    keys, hit = _lookup(store, source, saved, sealed=True)

    assert seal_key(_key(source, saved, 0)) in keys and seal_key(_key(source, saved, 2)) in keys
    assert hit == 0  # the span's only seal is gone: no chunk has one that may vouch for it
    assert _lookup(store, source, saved, sealed=False)[1] == 48


async def test_a_lookup_under_required_counts_a_chunk_whose_span_is_anchored_before_it():
    source, store, saved = await _saved()

    assert _lookup(store, source, saved, sealed=True)[1] == 48


def test_the_checksum_is_xxh3_of_the_object_s_bytes_in_buffer_order():
    parts = [os.urandom(100), b"", os.urandom(7)]
    buffers = [ctypes.create_string_buffer(part, len(part)) for part in parts]

    got = checksum([ctypes.addressof(b) for b in buffers], [len(p) for p in parts])

    assert got == xxhash.xxh3_64_intdigest(b"".join(parts))


def test_a_fingerprint_follows_the_bytes_not_how_an_object_is_split_into_buffers():
    engine = _kv()
    one_buffer = replace(  # a staging slot: the same object as one region
        engine.kv,
        shards=tuple(
            replace(shard, layouts={0: replace(shard.layouts[0], regions=(shard.layouts[0].regions[0],))})
            for shard in engine.kv.shards
        ),
    )

    assert fingerprint(engine.kv) == fingerprint(_kv(seed=5).kv)
    assert fingerprint(engine.kv) != fingerprint(_kv(byte_facts=BFLOAT16).kv)
    assert fingerprint(engine.kv) != fingerprint(one_buffer)  # half the bytes: another object size


def test_a_seal_round_trips_and_other_bytes_are_no_seal():
    seal = Seal(bytes(range(16)), tuple(SealEntry(i, 4096, 2**64 - 1 - i) for i in range(3)))

    assert Seal.unpack(seal.pack()) == seal and len(seal.pack()) == SEAL_SIZE
    assert Seal.unpack(os.urandom(SEAL_SIZE)) is None
    assert Seal.unpack(seal.pack()[:-1]) is None


def test_a_seal_holds_at_most_a_span_of_entries():
    with pytest.raises(ValueError, match=f"at most {SEAL_SPAN} entries"):
        Seal(bytes(16), tuple(SealEntry(i, 1, 1) for i in range(SEAL_SPAN + 1))).pack()


def test_a_seal_is_judged_by_its_fingerprint_before_its_checksum():
    data = ctypes.create_string_buffer(b"kv bytes", 8)
    spans = ([ctypes.addressof(data)], [8])
    ours, theirs = b"\1" * 16, b"\2" * 16
    intact = SealEntry(key_id("k"), 8, xxhash.xxh3_64_intdigest(b"kv bytes"))

    assert judge(Vouch(ours, intact), *spans, ours, Integrity.VERIFY) is Verdict.VERIFIED
    assert judge(Vouch(theirs, intact), *spans, ours, Integrity.VERIFY) is Verdict.FOREIGN
    assert judge(Vouch(ours, intact._replace(checksum=0)), *spans, ours, Integrity.VERIFY) is Verdict.CORRUPT
    assert judge(None, *spans, ours, Integrity.VERIFY) is Verdict.UNVERIFIED
    assert judge(None, *spans, ours, Integrity.REQUIRED) is Verdict.UNSEALED
    assert judge(None, *spans, ours, Integrity.VERIFY, damaged_seal=True) is Verdict.CORRUPT


def _record(request: str, group: int, chunk: int) -> StoreObject:
    chunk_hash = bytes([chunk]) * 4
    return StoreObject(f"m@group:{group}@{chunk_hash.hex()}", chunk_hash, group, (), request_id=request, chunk_index=chunk)


def test_spans_hold_one_request_and_stream_each_within_a_span_of_chunks_from_the_anchor():
    records = [
        *(_record("a", 0, chunk) for chunk in (3, 1, 2, 1 + SEAL_SPAN, SEAL_SPAN)),
        _record("a", 1, 1),
        _record("b", 0, 2),
    ]

    spans = [[(records[p].request_id, records[p].store_group, records[p].chunk_index) for p in span] for span in seal_spans(records)]

    assert spans == [
        [("a", 0, 1), ("a", 0, 2), ("a", 0, 3), ("a", 0, SEAL_SPAN)],
        [("a", 0, 1 + SEAL_SPAN)],
        [("a", 1, 1)],
        [("b", 0, 2)],
    ]
