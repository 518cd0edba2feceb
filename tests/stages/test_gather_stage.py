"""``gather`` copies many-buffer objects into one staging buffer each, within a bounded pool."""

import copy
import ctypes
import threading

import anyio
import pytest
import torch
import xxhash
from pydantic import ValidationError

from kvpipe.connector.store.memory import Faults, MemoryStore
from kvpipe.pipeline import Pipeline, build_graph
from kvpipe.pipeline.testing import RecordingEmit, batch_of
from kvpipe.stages import (
    DEFAULT_SAVE_PIPELINE,
    KV_STAGES,
    BlockLayout,
    Buffer,
    FullChunksStage,
    GatherParams,
    GatherStage,
    ProjectedRequest,
    Region,
    Seal,
    StagingPool,
    StagingSlot,
    StoreObject,
    copy_into_slots,
    default_save_graph,
    gather_into_slots,
    seal_key,
    staging,
    storable_groups,
)
from kvpipe.stages.integrity import SEAL_SIZE

from .kv_fixtures import make_kv, make_request
from .openmp import openmp_workers

LAYERS = 8  # 8 buffers of 512 bytes per object: well under the auto threshold


class NetworkStore(MemoryStore):
    """The memory model, saying its puts cross a network (as a Mooncake peer's segment)."""

    local_transfers = False


async def _records(kv, tokens=64, **request):
    await FullChunksStage(kv).process(
        ProjectedRequest(make_request(kv, tokens=tokens, **request), storable_groups(kv)),
        emit := RecordingEmit(),
    )
    (records,) = emit.emitted["out"]
    return records


async def _gathered(stage, *items):
    batch = batch_of(items)
    await stage.process_batch(batch)
    return [entry.emit.emitted["out"] for entry in batch]


def _read(buffer: Buffer) -> bytes:
    return ctypes.string_at(buffer.address, buffer.size)


async def test_auto_sends_a_many_buffer_object_as_one_buffer_holding_the_same_bytes():
    fixture = make_kv(layers=LAYERS)
    records = await _records(fixture.kv)
    stage = GatherStage(GatherParams(), fixture.kv, NetworkStore())
    [[out]] = await _gathered(stage, records)
    for record in out:
        (staged,) = record.transfer_buffers
        assert _read(staged) == b"".join(_read(buffer) for buffer in record.buffers)


async def test_a_gathered_record_keeps_its_key_group_id_and_engine_buffers():
    fixture = make_kv(layers=LAYERS)
    records = await _records(fixture.kv)
    [[out]] = await _gathered(GatherStage(GatherParams(), fixture.kv, NetworkStore()), records)
    assert [(r.key, r.group_id, r.buffers) for r in out] == [(r.key, r.group_id, r.buffers) for r in records]


async def test_a_gather_far_above_torchs_grain_starts_no_openmp_pool_in_its_thread():
    rows = torch.randint(0, 256, (512, 8192), dtype=torch.uint8)  # 4 rows of 8 KiB per object
    records = [
        StoreObject(f"k{n}", b"h", 0, [Buffer(rows[n + 128 * r].data_ptr(), 8192) for r in range(4)])
        for n in range(128)
    ]  # one copy of 4 MiB, 512 times torch's grain in 8-byte words
    pool = StagingPool(NetworkStore(), len(records), records[0].size)
    pool.allocate()
    slots = await pool.acquire_run(len(records))
    torch.zeros(1 << 24, dtype=torch.uint8)  # this (the engine's) thread has its pool
    before = openmp_workers()
    gathered, over = threading.Event(), threading.Event()

    def gather_in_a_worker_thread() -> None:  # as the stage's thread does, and lives on after it
        gather_into_slots(records, slots)
        gathered.set()
        over.wait(10)

    worker = threading.Thread(target=gather_in_a_worker_thread)
    worker.start()
    try:
        assert gathered.wait(10)
        during = openmp_workers()
    finally:
        over.set()
        worker.join()
    assert during <= before
    for record, slot in zip(records, slots, strict=True):
        assert ctypes.string_at(slot.address, record.size) == b"".join(_read(b) for b in record.buffers)


async def test_auto_leaves_objects_whose_buffers_are_large_as_they_are():
    fixture = make_kv(layers=LAYERS)
    records = await _records(fixture.kv)
    stage = GatherStage(GatherParams(below_bytes=512), fixture.kv, NetworkStore())  # buffers are 512 B
    [[out]] = await _gathered(stage, records)
    assert all(record.staging is None for record in out)


async def test_auto_leaves_single_buffer_objects_as_they_are():
    fixture = make_kv(layers=1)
    [[out]] = await _gathered(
        GatherStage(GatherParams(), fixture.kv, NetworkStore()), await _records(fixture.kv)
    )
    assert all(record.staging is None for record in out)


async def test_always_gathers_even_single_buffer_objects():
    fixture = make_kv(layers=1)
    stage = GatherStage(GatherParams(mode="always"), fixture.kv, NetworkStore())
    [[out]] = await _gathered(stage, await _records(fixture.kv))
    assert all(record.staging is not None for record in out)


async def test_never_gathers_nothing():
    fixture = make_kv(layers=LAYERS)
    stage = GatherStage(GatherParams(mode="never"), fixture.kv, NetworkStore())
    [[out]] = await _gathered(stage, await _records(fixture.kv))
    assert all(record.staging is None for record in out)


async def test_buffers_that_are_not_rows_of_one_region_are_copied_one_by_one():
    fixture = make_kv(layers=LAYERS)
    records = await _records(fixture.kv)
    first, second = records[0], records[1]
    # the second object's layers in reverse: position j no longer strides like the first's
    shuffled = StoreObject("shuffled", second.chunk_hash, 0, second.buffers[::-1])
    stage = GatherStage(GatherParams(), fixture.kv, NetworkStore())
    [[out]] = await _gathered(stage, (first, shuffled))
    for record in out:
        assert _read(record.transfer_buffers[0]) == b"".join(_read(b) for b in record.buffers)


async def test_an_entry_with_more_objects_than_slots_sends_the_rest_ungathered():
    fixture = make_kv(layers=LAYERS)
    records = await _records(fixture.kv, tokens=64)  # 4 chunks of 4 KiB
    stage = GatherStage(GatherParams(pool_bytes=4 * 4096), fixture.kv, NetworkStore())  # 4 slots, 2 a round
    [[out]] = await _gathered(stage, records)
    assert [record.staging is not None for record in out] == [True, True, False, False]


async def test_gathering_waits_for_slots_and_the_put_gives_them_back():
    fixture = make_kv(layers=LAYERS, num_blocks=64)
    store = NetworkStore()
    document = copy.deepcopy(DEFAULT_SAVE_PIPELINE)
    [gather_spec] = [stage for stage in document["stages"] if stage["name"] == "gather"]
    gather_spec["params"]["pool_bytes"] = 4 * 4096  # 4 slots: far fewer than the objects in flight
    graph = build_graph(document, KV_STAGES, {"kv": fixture.kv, "store": store})
    gather_stage = graph.spec("gather").stage
    async with Pipeline(graph) as pipeline:
        jobs = [
            await pipeline.submit(make_request(fixture.kv, 160, request_id=f"r{i}", first_block=1 + 10 * i))
            for i in range(6)
        ]
        await pipeline.close()
    assert all(job.counts["put"] == 10 for job in jobs)
    assert gather_stage.pool.free == gather_stage.pool.slots


async def test_a_store_that_refuses_the_staging_memory_gets_the_objects_ungathered():
    class RefusingStore(NetworkStore):
        def register_buffer(self, addr, nbytes):
            return -600

    fixture = make_kv(layers=LAYERS)
    stage = GatherStage(GatherParams(), fixture.kv, RefusingStore())
    batch = batch_of([await _records(fixture.kv)])
    await stage.process_batch(batch)
    [out] = batch[0].emit.emitted["out"]
    assert all(record.staging is None for record in out)
    assert batch[0].emit.counts["gather_failed"] == 1


async def test_the_default_graph_stores_gathered_objects_byte_for_byte():
    fixture = make_kv(layers=LAYERS)
    store = NetworkStore()
    async with Pipeline(default_save_graph(fixture.kv, store, gather="always")) as pipeline:
        job = await pipeline.submit(make_request(fixture.kv, 64))
        await pipeline.close()
    assert job.counts["put"] == 4
    records = await _records(fixture.kv)
    for record in records:
        size = record.size
        destination = ctypes.create_string_buffer(size)
        assert store.batch_get_into([record.key], [ctypes.addressof(destination)], [size]) == [size]
        assert destination.raw == b"".join(_read(b) for b in record.buffers)


async def test_an_entry_whose_objects_are_all_staged_is_emitted_released():
    fixture = make_kv(layers=LAYERS)
    batch = batch_of([await _records(fixture.kv)])
    await GatherStage(GatherParams(), fixture.kv, NetworkStore()).process_batch(batch)
    assert batch[0].emit.released == batch[0].emit.emitted["out"]


async def test_an_entry_with_an_ungathered_object_still_borrows_the_engine_memory():
    fixture = make_kv(layers=LAYERS)
    batch = batch_of([await _records(fixture.kv)])
    await GatherStage(GatherParams(mode="never"), fixture.kv, NetworkStore()).process_batch(batch)
    assert batch[0].emit.released == []


async def test_a_save_is_released_while_its_slow_put_is_still_running():
    fixture = make_kv(layers=LAYERS)
    store = NetworkStore(faults=Faults(latency_s={"put": 0.3}))
    async with Pipeline(default_save_graph(fixture.kv, store)) as pipeline:
        job = await pipeline.submit(make_request(fixture.kv, 64))
        with anyio.fail_after(2):
            while not job.released:
                await anyio.sleep(0.005)
        assert not job.done
    assert job.counts["put"] == 4


async def test_auto_gathers_nothing_for_a_store_whose_puts_are_local_copies():
    fixture = make_kv(layers=LAYERS)
    stage = GatherStage(GatherParams(), fixture.kv, MemoryStore())
    [[out]] = await _gathered(stage, await _records(fixture.kv))
    assert all(record.staging is None for record in out)


async def test_always_gathers_for_a_local_store_too():
    fixture = make_kv(layers=LAYERS)
    stage = GatherStage(GatherParams(mode="always"), fixture.kv, MemoryStore())
    [[out]] = await _gathered(stage, await _records(fixture.kv))
    assert all(record.staging is not None for record in out)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"mode": "sometimes"}, "mode"),
        ({"pool_bytes": 0}, "pool_bytes"),
        ({"below_bytes": -1}, "below_bytes"),
    ],
)
def test_bad_params_name_the_field(params, field):
    with pytest.raises(ValidationError, match=field):
        GatherParams(**params)


def test_a_gather_with_nothing_to_gather_passes_through():
    fixture = make_kv(layers=LAYERS)
    assert GatherStage(GatherParams(), fixture.kv, MemoryStore()).passes_through  # local puts: never
    assert GatherStage(GatherParams(mode="never"), fixture.kv, NetworkStore()).passes_through
    assert not GatherStage(GatherParams(), fixture.kv, NetworkStore()).passes_through


class _NoRegistration:
    def register_buffer(self, addr, nbytes):
        return 0

    def unregister_buffer(self, addr):
        return 0


async def test_the_pool_hands_out_runs_of_neighbours_that_never_wrap():
    pool = StagingPool(_NoRegistration(), slots=8, slot_bytes=64)
    pool.allocate()
    first = await pool.acquire_run(5)
    for slot in first:
        slot.release()
    second = await pool.acquire_run(4)  # 5..8 would pass the end: it starts again at 0
    assert [s.index for s in first] == [0, 1, 2, 3, 4]
    assert [s.index for s in second] == [0, 1, 2, 3]
    assert pool.free == 4


async def test_a_run_waits_until_its_slots_are_given_back():
    pool = StagingPool(_NoRegistration(), slots=4, slot_bytes=64)
    pool.allocate()
    held = await pool.acquire_run(4)
    got = []

    async def take():
        got.append(await pool.acquire_run(2))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(take)
        await anyio.sleep(0.01)
        assert got == []
        held[0].release()
        held[1].release()
    assert [s.index for s in got[0]] == [0, 1]


def test_a_run_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="a run of 5 slots from a pool of 4"):
        anyio.run(StagingPool(_NoRegistration(), slots=4, slot_bytes=64).acquire_run, 5)


async def test_slots_out_of_order_get_the_same_bytes_as_a_run():
    fixture = make_kv(layers=LAYERS)
    records = await _records(fixture.kv)
    pool = StagingPool(_NoRegistration(), slots=8, slot_bytes=records[0].size)
    pool.allocate()
    scattered = [StagingSlot(pool, index) for index in (6, 1, 4, 3)]
    copy_into_slots(records, scattered)
    for record, slot in zip(records, scattered, strict=True):
        assert ctypes.string_at(slot.address, record.size) == b"".join(_read(b) for b in record.buffers)


def _checksum_of(record: StoreObject) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(_read(buffer) for buffer in record.buffers))


def _grid_records(count: int) -> list[StoreObject]:
    """``count`` objects whose buffers are rows of one tensor (every layer's blocks in one grid)."""
    grid = torch.randn(LAYERS, 16, 256)  # 1 KiB rows
    layout = BlockLayout(tuple(Region(layer.data_ptr(), 1024) for layer in grid))
    _grid_records.keep = grid  # type: ignore[attr-defined]  # alive while the test reads it
    return [StoreObject(f"grid-{b}", bytes([b]) * 32, 0, layout.buffers(b)) for b in range(1, count + 1)]


@pytest.mark.parametrize("piece_objects", [1, 3, 64], ids=["a piece each", "pieces of 3", "one piece"])
@pytest.mark.parametrize("order", ["a run", "out of order", "not rows of one region", "rows of one grid"])
async def test_a_copy_asked_for_checksums_gives_each_slot_its_objects_checksum(order, piece_objects, monkeypatch):
    fixture = make_kv(layers=LAYERS)
    records = list(await _records(fixture.kv, tokens=96))  # 6 objects, each layer a tensor of its own
    if order == "not rows of one region":  # copied one object at a time
        records[1] = StoreObject("shuffled", records[1].chunk_hash, 0, records[1].buffers[::-1])
    if order == "rows of one grid":  # copied by one indexed copy per piece
        records = _grid_records(6)
    monkeypatch.setattr(staging, "HASHED_PIECE_BYTES", piece_objects * records[0].size)
    pool = StagingPool(_NoRegistration(), slots=8, slot_bytes=records[0].size)
    pool.allocate()
    indexes = (7, 1, 5, 3, 0, 2) if order == "out of order" else range(6)
    slots = [StagingSlot(pool, index) for index in indexes]
    copy_into_slots(records, slots, checksums=True)
    assert [slot.checksum for slot in slots] == [_checksum_of(record) for record in records]


async def test_a_copy_not_asked_for_checksums_takes_none():
    fixture = make_kv(layers=LAYERS)
    records = await _records(fixture.kv)
    pool = StagingPool(_NoRegistration(), slots=4, slot_bytes=records[0].size)
    pool.allocate()
    slots = [StagingSlot(pool, index) for index in range(len(records))]
    copy_into_slots(records, slots)
    assert [slot.checksum for slot in slots] == [None] * len(records)


async def _saved_through_the_default_graph(fixture, store, integrity):
    async with Pipeline(default_save_graph(fixture.kv, store, gather="always", integrity=integrity)) as pipeline:
        job = await pipeline.submit(make_request(fixture.kv, 64))
        await pipeline.close()
    assert job.counts["put"] == 4


async def test_the_default_graph_seals_gathered_objects_with_the_checksums_taken_as_they_were_copied(monkeypatch):
    monkeypatch.setattr(staging, "checksum", lambda addresses, sizes: 42)  # what the gather took, if used
    fixture = make_kv(layers=LAYERS)
    store = NetworkStore()
    await _saved_through_the_default_graph(fixture, store, "verify")
    anchor = (await _records(fixture.kv))[0]
    destination = ctypes.create_string_buffer(SEAL_SIZE)
    assert store.batch_get_into([seal_key(anchor.key)], [ctypes.addressof(destination)], [SEAL_SIZE]) == [SEAL_SIZE]
    seal = Seal.unpack(destination.raw)
    assert seal is not None and [entry.checksum for entry in seal.entries] == [42] * 4


async def test_the_default_graph_without_seals_takes_no_checksum_at_the_gather(monkeypatch):
    taken = []
    monkeypatch.setattr(staging, "checksum", lambda addresses, sizes: taken.append(addresses) or 42)
    await _saved_through_the_default_graph(make_kv(layers=LAYERS), NetworkStore(), "off")
    assert taken == []
