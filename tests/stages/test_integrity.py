"""Seals end to end on the stages: what a put seals, what a load makes of it, what lookups ask.

Every fault here is a store object whose bytes are not the bytes its writer put;
none of them may reach the engine as loaded, and each is counted by its verdict.
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
    LookupRequest,
    Seal,
    Verdict,
    fingerprint,
    is_seal_key,
    longest_stored_prefix,
    lookup_keys,
    object_key,
    seal_key,
    storable_groups,
)
from kvpipe.stages.integrity import SEAL_SIZE, checksum, judge

from .kv_fixtures import FULL, make_kv, make_request
from .save_path import run_save_path
from .stores import ScriptedStore

TARGET_BLOCKS = (10, 11, 12)  # where the loading engine put the chunks saved from blocks 1, 2, 3
FLOAT16 = (("dtype", '"torch.float16"'),)
BFLOAT16 = (("dtype", '"torch.bfloat16"'),)


def _kv(seed: int = 0, byte_facts=FLOAT16):
    fixture = make_kv([FULL], seed=seed)
    fixture.kv = replace(fixture.kv, byte_facts=byte_facts)
    return fixture


async def _saved(*, sealed: bool = True):
    """A source cache, a store holding its 3 chunks (sealed unless told otherwise), the request."""
    source = _kv()
    store = MemoryStore(lease_ttl_s=0)
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


async def _load(kv, store, saved, *, threads: int = 1, **params):
    """Load the request's 3 chunks into TARGET_BLOCKS: (the job's handle, the failed block ids)."""
    failed: dict[str, frozenset[int]] = {}
    request = LoadRequest("load", saved.block_hashes, (TARGET_BLOCKS,), 0, 48)
    (entry,) = batch = batch_of([request])
    stage = LoadStage(LoadParams(**params), kv, store, lambda rid, ids: failed.setdefault(rid, ids))
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
async def test_an_object_whose_bytes_are_not_as_sealed_fails_its_block_and_is_removed_with_its_seal(damage):
    source, store, saved = await _saved()
    key = _key(source, saved, 1)
    _write(store, key, damage(source.block_bytes(0, 0, 2)))

    emit, failed = await _load(_kv(seed=1).kv, store, saved)

    assert failed == {TARGET_BLOCKS[1]}
    assert (emit.counts["loaded"], emit.counts["integrity_corrupt"], emit.counts["failed"]) == (2, 1, 1)
    assert "integrity: corrupt" in str(emit.failures[0])
    assert store.batch_is_exist([key, seal_key(key)]) == [0, 0]


@pytest.mark.parametrize("threads", [2, 3])
async def test_verdicts_judged_in_several_threads_land_on_their_own_objects(threads):
    source, store, saved = await _saved()
    _write(store, _key(source, saved, 1), _same_size_garbage(source.block_bytes(0, 0, 2)))

    emit, failed = await _load(_kv(seed=1).kv, store, saved, threads=threads)

    assert failed == {TARGET_BLOCKS[1]}
    assert (emit.counts["integrity_verified"], emit.counts["integrity_corrupt"]) == (2, 1)


async def test_a_damaged_seal_fails_its_block_and_goes_with_its_object():
    source, store, saved = await _saved()
    key = _key(source, saved, 0)
    _write(store, seal_key(key), os.urandom(SEAL_SIZE))

    emit, failed = await _load(_kv(seed=1).kv, store, saved)

    assert failed == {TARGET_BLOCKS[0]} and emit.counts["integrity_corrupt"] == 1
    assert store.batch_is_exist([key, seal_key(key)]) == [0, 0]


async def test_a_seal_larger_than_a_seal_is_a_damaged_seal():
    """(One smaller reads as a failed transfer, -800, which says nothing of the bytes: a failed
    block, recomputed, nothing removed.)"""
    source, store, saved = await _saved()
    key = _key(source, saved, 2)
    _write(store, seal_key(key), os.urandom(2 * SEAL_SIZE))

    emit, failed = await _load(_kv(seed=1).kv, store, saved)

    assert failed == {TARGET_BLOCKS[2]} and emit.counts["integrity_corrupt"] == 1


async def test_a_seal_smaller_than_a_seal_fails_its_block_and_removes_nothing():
    source, store, saved = await _saved()
    key = _key(source, saved, 2)
    _write(store, seal_key(key), b"short")

    emit, failed = await _load(_kv(seed=1).kv, store, saved)

    assert failed == {TARGET_BLOCKS[2]} and "its seal: -800" in str(emit.failures[0])
    assert store.batch_is_exist([key, seal_key(key)]) == [1, 1]


async def test_an_object_stored_without_its_seal_is_counted_unsealed():
    source = _kv()
    store = ScriptedStore(put=lambda key: Code.NO_SPACE if is_seal_key(key) else Code.OK)

    run = await run_save_path(source.kv, store, [make_request(source.kv, 48)])

    assert (run.counts["put"], run.counts["unsealed"]) == (3, 3)


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


async def test_a_put_seals_each_object_with_its_checksum_and_fingerprint():
    source, store, saved = await _saved()

    for chunk in range(3):
        seal = Seal.unpack(_read(store, seal_key(_key(source, saved, chunk)), SEAL_SIZE) or b"")
        data = source.block_bytes(0, 0, 1 + chunk)
        assert seal == Seal(len(data), fingerprint(source.kv), xxhash.xxh3_64_intdigest(data))


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
    assert refailed == frozenset() and second.counts["integrity_verified"] == 3


def _lookup(store, fixture, saved, sealed):
    groups = storable_groups(fixture.kv)
    request = LookupRequest("r", saved.block_hashes, 49)
    keys = lookup_keys(groups, fixture.kv.shards, 16, request, sealed=sealed)
    exists = dict(zip(keys, (code == 1 for code in store.batch_is_exist(list(keys))), strict=True))
    return keys, longest_stored_prefix(groups, fixture.kv.shards, 16, request, exists, sealed=sealed)


async def test_a_lookup_under_required_asks_for_seals_and_misses_a_chunk_without_them():
    source, store, saved = await _saved()
    store.remove(seal_key(_key(source, saved, 1)), force=True)

    keys, hit = _lookup(store, source, saved, sealed=True)

    assert seal_key(_key(source, saved, 0)) in keys
    assert hit == 16  # chunk 1 has no seal: the prefix stops before it
    assert _lookup(store, source, saved, sealed=False)[1] == 48


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
    seal = Seal(4096, bytes(range(16)), 2**64 - 1)

    assert Seal.unpack(seal.pack()) == seal and len(seal.pack()) == SEAL_SIZE
    assert Seal.unpack(os.urandom(SEAL_SIZE)) is None
    assert Seal.unpack(seal.pack()[:-1]) is None


def test_a_seal_is_judged_by_its_fingerprint_before_its_checksum():
    data = ctypes.create_string_buffer(b"kv bytes", 8)
    spans = ([ctypes.addressof(data)], [8])
    ours, theirs = b"\1" * 16, b"\2" * 16
    intact = Seal(8, ours, xxhash.xxh3_64_intdigest(b"kv bytes")).pack()

    assert judge(intact, *spans, ours, Integrity.VERIFY) is Verdict.VERIFIED
    assert judge(intact, *spans, theirs, Integrity.VERIFY) is Verdict.FOREIGN
    assert judge(Seal(8, ours, 0).pack(), *spans, ours, Integrity.VERIFY) is Verdict.CORRUPT
    assert judge(None, *spans, ours, Integrity.VERIFY) is Verdict.UNVERIFIED
    assert judge(None, *spans, ours, Integrity.REQUIRED) is Verdict.UNSEALED
