"""``full`` and ``tail`` make one record per chunk per storable group per shard."""

from kvpipe.pipeline.testing import RecordingEmit
from kvpipe.stages import (
    FullChunksStage,
    GroupKind,
    GroupSpec,
    ProjectedRequest,
    StoreObject,
    TailStage,
    object_key,
    storable_groups,
)

from .kv_fixtures import FULL, MAMBA_ALIGN, RING, make_kv, make_request

BIG = GroupSpec(GroupKind.FULL_ATTENTION, block_size=32)


async def _collect(stage_class, kv, request):
    await stage_class(kv).process(ProjectedRequest(request, storable_groups(kv)), emit := RecordingEmit())
    return emit


def _first_block_records(kv, request):
    """The records of ``request``'s first chunk (block 1) in the FULL (0) and MAMBA_ALIGN (engine group 2) groups."""
    chunk_hash = request.block_hashes[0]
    return [
        StoreObject(
            key=object_key(shard.namespace, store_group, chunk_hash),
            chunk_hash=chunk_hash,
            store_group=store_group,
            buffers=shard.layouts[engine_group].buffers(1),
            request_id=request.request_id,
        )
        for store_group, engine_group in ((0, 0), (1, 2))
        for shard in kv.shards
    ]


async def test_full_makes_one_record_per_chunk_per_storable_group_per_shard():
    kv = make_kv([FULL, RING], shards=2).kv
    request = make_request(kv, tokens=40)

    emit = await _collect(FullChunksStage, kv, request)

    (records,) = emit.emitted["out"]
    assert len(records) == 2 * 2  # chunks x shards (the ring is not stored)
    assert emit.counts["considered"] == 4
    assert {(r.store_group, r.key.split("@")[1]) for r in records} == {
        (0, f"tp_rank:{rank}") for rank in (0, 1)
    }


async def test_a_mamba_group_gives_one_record_per_shard_the_state_at_the_computed_end():
    kv = make_kv([FULL, RING, MAMBA_ALIGN], shards=2).kv
    request = make_request(kv, tokens=32)

    (records,) = (await _collect(FullChunksStage, kv, request)).emitted["out"]

    chunks = sorted({(r.store_group, request.block_hashes.index(r.chunk_hash)) for r in records})
    assert chunks == [(0, 0), (0, 1), (1, 1)]  # attention: every chunk; mamba: the state at 32
    assert len(records) == 3 * 2


async def test_a_mamba_group_has_no_chunk_while_the_computed_end_is_inside_a_block():
    kv = make_kv([FULL, RING, MAMBA_ALIGN]).kv
    request = make_request(kv, tokens=40)  # the engine holds the state at 40: no block boundary

    (records,) = (await _collect(FullChunksStage, kv, request)).emitted["out"]

    assert {r.store_group for r in records} == {0}


async def test_each_record_carries_its_own_key_hash_and_block_buffers():
    kv = make_kv([FULL, RING, MAMBA_ALIGN], shards=2).kv
    request = make_request(kv, tokens=16, request_id="req-7")

    (records,) = (await _collect(FullChunksStage, kv, request)).emitted["out"]

    assert list(records) == _first_block_records(kv, request)
    assert all(r.group_id is None and r.request_id == "req-7" for r in records)


async def test_a_stage_gives_each_later_request_its_own_groups_keys_and_blocks():
    kv = make_kv([FULL, RING, MAMBA_ALIGN], shards=2).kv
    stage = FullChunksStage(kv)
    groups = storable_groups(kv)
    first = make_request(kv, tokens=40, request_id="req-1")  # group 0 only: no mamba state at 40
    second = make_request(kv, tokens=16, request_id="req-2")  # groups 0 and 1

    await stage.process(ProjectedRequest(first, groups), RecordingEmit())
    await stage.process(ProjectedRequest(second, groups), emit := RecordingEmit())

    (records,) = emit.emitted["out"]
    assert list(records) == _first_block_records(kv, second)


async def test_full_records_put_the_earlier_prefix_first():
    # chunks end every 32 tokens in group 0, every 16 in group 1
    kv = make_kv([BIG, FULL], hash_block_size=16).kv
    request = make_request(kv, tokens=64)

    (records,) = (await _collect(FullChunksStage, kv, request)).emitted["out"]

    h = request.block_hashes
    assert [(r.store_group, r.chunk_hash) for r in records] == [
        (1, h[0]),
        (0, h[1]),
        (1, h[1]),
        (1, h[2]),
        (0, h[3]),
        (1, h[3]),
    ]


async def test_full_drops_a_request_whose_chunks_are_all_saved():
    kv = make_kv().kv

    emit = await _collect(FullChunksStage, kv, make_request(kv, tokens=32, saved=32))

    assert emit.dropped == ["no chunk to save"]
    assert emit.counts["considered"] == 0


async def test_tail_makes_one_record_per_storable_group_per_shard_with_the_whole_block():
    kv = make_kv([BIG, RING], shards=3, hash_block_size=16).kv
    request = make_request(kv, tokens=32 + 16 + 5, finished=True)

    emit = await _collect(TailStage, kv, request)

    (records,) = emit.emitted["out"]
    assert emit.counts["considered"] == 3
    assert {r.chunk_hash for r in records} == {request.block_hashes[2]}
    assert [r.buffers for r in records] == [shard.layouts[0].buffers(2) for shard in kv.shards]


async def test_tail_drops_a_request_without_a_tail():
    kv = make_kv().kv

    emit = await _collect(TailStage, kv, make_request(kv, tokens=40, finished=True))

    assert emit.dropped == ["no chunk to save"]
