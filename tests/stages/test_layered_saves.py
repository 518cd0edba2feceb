"""A layer-wise save writes its objects a layer at a time, and they become visible only once the step ends well.

The save path runs as the default pipeline wires it (``save_path.py``) on a
request whose ``layers`` is a :class:`Steps` the test drives as the engine would:
each wave readable once the forward computed that layer, then the step's verdict.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import replace

import anyio

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.pipeline.testing import batch_of
from kvpipe.stages import LoadParams, LoadRequest, LoadStage, SaveRequest, object_key
from kvpipe.stages.store import Code

from .kv_fixtures import FULL, KVFixture, make_kv, make_request
from .save_path import run_save_path

LAYERS = 3


class Steps:
    """A :class:`~kvpipe.stages.model.LayerProgress` driven by a test: ``done(step)`` for each, ``called_off()``."""

    def __init__(self, waves: tuple[tuple[tuple[int, int], ...], ...], *, upto: int | None = None) -> None:
        self.waves = waves
        self._done = threading.Condition()
        self._upto = len(waves) + 1 if upto is None else upto  # steps done so far (all of them by default)
        self._off = False
        self.asked: list[int] = []

    def done(self, step: int) -> None:
        with self._done:
            self._upto = max(self._upto, step + 1)
            self._done.notify_all()

    def called_off(self) -> None:
        with self._done:
            self._off = True
            self._done.notify_all()

    def wait(self, step: int, timeout_s: float) -> bool:
        self.asked.append(step)
        with self._done:
            self._done.wait_for(lambda: self._off or self._upto > step, timeout_s)
            return not self._off and self._upto > step


def _waves(fixture: KVFixture) -> tuple[tuple[tuple[int, int], ...], ...]:
    region = fixture.kv.shards[0].layouts[0].regions[0].bytes_per_block
    return tuple(((layer * region, region),) for layer in range(LAYERS))


def _keys(fixture: KVFixture, request: SaveRequest) -> list[str]:
    return [
        object_key(shard.namespace, 0, chunk_hash) for shard in fixture.kv.shards for chunk_hash in request.block_hashes
    ]


async def test_objects_saved_layer_by_layer_equal_those_saved_whole() -> None:
    source = make_kv((FULL,), shards=2, layers=LAYERS, seed=0)
    request = make_request(source.kv, 48)
    whole, layered = MemoryStore(), MemoryStore()
    await run_save_path(source.kv, whole, [request])

    run = await run_save_path(source.kv, layered, [replace(request, layers=Steps(_waves(source)))])

    assert run.counts["put"] == 6
    for key in _keys(source, request):
        assert layered.get_size(key) == whole.get_size(key)
        assert _read(layered, key) == _read(whole, key)


async def test_a_layer_by_layer_save_loads_verified() -> None:
    source = make_kv((FULL,), shards=2, layers=LAYERS, seed=0)
    request = make_request(source.kv, 48)
    store = MemoryStore(lease_ttl_s=0)
    await run_save_path(source.kv, store, [replace(request, layers=Steps(_waves(source)))])
    target = make_kv((FULL,), shards=2, layers=LAYERS, seed=1)

    load = LoadRequest("l", request.block_hashes, ((10, 11, 12),), 0, 48)
    (entry,) = batch = batch_of([load])
    stage = LoadStage(LoadParams(), target.kv, store)
    await stage.process_batch(batch)
    await stage.stop()

    assert (entry.emit.counts["loaded"], entry.emit.counts["integrity_verified"]) == (6, 6)


async def test_nothing_is_visible_until_the_step_ends_well_and_every_layer_is_written_before() -> None:
    source = make_kv((FULL,), shards=1, layers=LAYERS, seed=0)
    request = make_request(source.kv, 16)
    store = MemoryStore()
    steps = Steps(_waves(source), upto=0)
    (key,) = _keys(source, request)
    seen: list[tuple[int, list[int]]] = []

    async def engine() -> None:
        for step in range(LAYERS + 1):
            await anyio.sleep(0.01)
            seen.append((step, store.batch_is_exist([key])))
            steps.done(step)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(engine)
        run = await run_save_path(source.kv, store, [replace(request, layers=steps)])

    assert [exists for _, exists in seen] == [[0]] * (LAYERS + 1)
    assert store.batch_is_exist([key]) == [1] and run.counts["put"] == 1


async def test_a_step_called_off_leaves_nothing_a_lookup_can_see() -> None:
    source = make_kv((FULL,), shards=2, layers=LAYERS, seed=0)
    request = make_request(source.kv, 48)
    store = MemoryStore()
    steps = Steps(_waves(source), upto=LAYERS)  # every layer written, the verdict not given
    steps.called_off()

    run = await run_save_path(source.kv, store, [replace(request, layers=steps)])

    assert store.batch_is_exist(_keys(source, request)) == [0] * 6
    assert (run.counts["failed_called_off"], run.counts["put"]) == (6, 0)
    assert store.batch_put_session_start([_keys(source, request)[0]], [1], store.new_replicate_config()) == [0]


async def test_a_save_called_off_midway_writes_no_further_layer() -> None:
    source = make_kv((FULL,), shards=1, layers=LAYERS, seed=0)
    request = make_request(source.kv, 16)
    store = MemoryStore()
    steps = Steps(_waves(source), upto=1)  # layer 0 computed
    writes: list[int] = []
    real = store.batch_put_from_multi_buffer_ranges

    def recorded(keys, ptrs, sizes, offsets):  # type: ignore[no-untyped-def]
        writes.append(offsets[0][0])
        return real(keys, ptrs, sizes, offsets)

    store.batch_put_from_multi_buffer_ranges = recorded  # type: ignore[method-assign]

    async def engine() -> None:
        await anyio.sleep(0.05)
        steps.called_off()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(engine)
        run = await run_save_path(source.kv, store, [replace(request, layers=steps)])

    assert writes == [0]
    assert run.counts["failed_called_off"] == 1
    assert store.batch_is_exist(_keys(source, request)) == [0]


async def test_a_layer_the_store_fails_to_write_revokes_its_object_unseen_and_the_chunk_is_saved_again_later() -> None:
    source = make_kv((FULL,), shards=1, layers=LAYERS, seed=0)
    request = make_request(source.kv, 16)
    store = MemoryStore()
    (key,) = _keys(source, request)
    real = store.batch_put_from_multi_buffer_ranges
    failing_wave = _waves(source)[1][0][0]

    def fails_layer_1(keys, ptrs, sizes, offsets):  # type: ignore[no-untyped-def]
        if offsets[0][0] == failing_wave:
            return [Code.TRANSFER_FAILED] * len(keys)
        return real(keys, ptrs, sizes, offsets)

    store.batch_put_from_multi_buffer_ranges = fails_layer_1  # type: ignore[method-assign]
    run = await run_save_path(source.kv, store, [replace(request, layers=Steps(_waves(source)))])

    assert (run.counts["failed_store_error"], run.counts["put"]) == (1, 0)
    assert store.batch_is_exist([key]) == [0]
    store.batch_put_from_multi_buffer_ranges = real  # type: ignore[method-assign]
    again = await run_save_path(source.kv, store, [replace(request, layers=Steps(_waves(source)))])
    assert again.counts["put"] == 1 and store.batch_is_exist([key]) == [1]


async def test_a_chunk_another_writer_is_saving_layer_by_layer_counts_as_existing_not_as_a_store_error() -> None:
    """Its session holds the key (a reservation answers -600): it is the other writer's, as a whole put
    of a reserved key is (the store answers that put 0 and keeps the reservation)."""
    source = make_kv((FULL,), shards=1, layers=LAYERS, seed=0)
    request = make_request(source.kv, 16)
    store = MemoryStore()
    (key,) = _keys(source, request)
    assert store.batch_put_session_start([key], [1], store.new_replicate_config()) == [0]

    run = await run_save_path(source.kv, store, [replace(request, layers=Steps(_waves(source)))])

    assert (run.counts["existing"], run.counts["failed_store_error"], run.counts["put"]) == (1, 0, 0)
    assert store.batch_is_exist([key]) == [0]  # still the other writer's, until it ends its session


def _read(store: MemoryStore, key: str) -> bytes:
    size = store.get_size(key)
    buffer = ctypes.create_string_buffer(size)
    assert store.batch_get_into([key], [ctypes.addressof(buffer)], [size]) == [size]
    return buffer.raw

