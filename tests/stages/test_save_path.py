"""The stages together: only missing objects are put, each with its own group id and bytes.

Regressions: a put must never pair a key with another object's group id, which
is what happens when group ids travel in a list beside the keys and filtering
drops an element of one list but not of the other.
"""

from dataclasses import replace

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.stages import GroupKind, GroupSpec, object_key, seal_key, storable_groups
from kvpipe.stages.keys import key_chunk_hex, sealed_key

from .kv_fixtures import RING, bytes_of, empty_bytes, make_kv, make_request
from .save_path import run_save_path
from .stores import RecordingStore

BIG = GroupSpec(GroupKind.FULL_ATTENTION, block_size=32)


def _own_group_id(key: str) -> str:
    """The group id a key's object (or its seal) must carry: the one of the chunk hash at the key's end."""
    return "vllm-mooncake-store:tiny-llama@" + key_chunk_hex(key)


def _with_seals(keys: list[str]) -> list[str]:
    """What a put call names for these objects, when each is its own span (another request or rank): each followed by its seal."""
    return [name for key in keys for name in (key, seal_key(key))]


async def test_tail_path_with_the_first_object_stored_puts_the_other_two_each_with_its_own_group_id():
    kv = make_kv([BIG], shards=3, hash_block_size=16).kv
    request = make_request(kv, tokens=32 + 16 + 5, saved=32, finished=True)  # a tail and nothing else
    memory = MemoryStore()
    await run_save_path(replace(kv, shards=kv.shards[:1]), memory, [request])  # rank 0 saved it first
    store = RecordingStore(memory)

    run = await run_save_path(kv, store, [request])

    assert store.exist_answers == [[1, 0, 0]]
    (call,) = store.put_calls
    assert call.keys == _with_seals([r.key for r in run.records[1:]])
    assert call.group_ids == [_own_group_id(key) for key in call.keys]
    assert run.counts["existing"] == 1 and run.counts["put"] == 2


async def test_full_path_with_the_first_object_stored_puts_the_other_two_each_with_its_own_group_id():
    kv = make_kv().kv
    memory = MemoryStore()
    await run_save_path(kv, memory, [make_request(kv, tokens=16)])  # an earlier step saved chunk 0
    store = RecordingStore(memory)

    run = await run_save_path(kv, store, [make_request(kv, tokens=48)])

    assert store.exist_answers == [[1, 0, 0]]
    (call,) = store.put_calls
    first, second = (r.key for r in run.records[1:])
    assert call.keys == [first, second, seal_key(first)]  # one request's run of chunks: one seal, anchored first
    assert call.group_ids == [_own_group_id(key) for key in call.keys]
    assert len(set(call.group_ids)) == 2
    assert run.counts["existing"] == 1 and run.counts["put"] == 2


async def test_a_filter_batch_mixing_requests_puts_each_missing_object_with_its_own_group_id():
    kv = make_kv().kv
    requests = [make_request(kv, tokens=16, request_id=f"req-{i}", first_block=1 + i) for i in range(3)]
    memory = MemoryStore()
    await run_save_path(kv, memory, requests[:1])
    store = RecordingStore(memory)

    run = await run_save_path(kv, store, requests)

    assert store.exist_answers == [[1, 0, 0]]
    (call,) = store.put_calls
    assert call.keys == _with_seals([r.key for r in run.records[1:]])
    assert call.group_ids == [_own_group_id(key) for key in call.keys]
    assert call.group_ids == [run.record(sealed_key(key)).group_id for key in call.keys]
    assert len(set(call.group_ids)) == 2


async def test_objects_read_back_are_the_original_block_bytes():
    fixture = make_kv([BIG, RING, BIG], shards=2, hash_block_size=16)
    kv = fixture.kv
    request = make_request(kv, tokens=2 * 32 + 16 + 3, finished=True)  # 2 chunks and a tail per group
    store = MemoryStore()

    run = await run_save_path(kv, store, [request])

    hashes = request.block_hashes
    expected = {
        object_key(shard.namespace, group.store_group, chunk_hash): fixture.block_bytes(
            rank, group.engine_group, request.block_ids[group.engine_group][block_index]
        )
        for rank, shard in enumerate(kv.shards)
        for group in storable_groups(kv)
        for chunk_hash, block_index in ((hashes[1], 0), (hashes[3], 1), (hashes[4], 2))
    }
    assert run.counts["put"] == len(expected) == 12
    keys = list(expected)
    destinations = [empty_bytes(len(expected[key])) for key in keys]
    read = store.batch_get_into_multi_buffers(
        keys, [[t.data_ptr()] for t in destinations], [[t.numel()] for t in destinations]
    )
    assert read == [len(expected[key]) for key in keys]
    assert [bytes_of(t) for t in destinations] == [expected[key] for key in keys]
