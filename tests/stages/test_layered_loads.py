"""A layered load reads its objects layer by layer, tells each layer's arrival, and judges the objects whole.

As in ``test_load_stage.py``, a request is saved from one cache with the real
save stages and loaded into other blocks of a second cache of fresh memory; here
the load request is ``layered`` and the cache says which byte ranges of an
object each layer needs (:data:`~kvpipe.stages.model.LayerWaves`).
"""

import ctypes
from dataclasses import replace

import pytest

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.pipeline.testing import batch_of
from kvpipe.stages import KVCache, LoadParams, LoadRequest, LoadStage, object_key, seal_key
from kvpipe.stages.keys import is_object_key, layer_seal_key
from kvpipe.stages.layers import GetSessions, wave_pieces
from kvpipe.stages.model import Buffer
from kvpipe.stages.store import Code

from .kv_fixtures import FULL, KVFixture, bytes_of, make_kv, make_request
from .save_path import run_save_path

LAYERS = 3
TARGET_BLOCKS = (10, 11, 12)


def _layered(fixture: KVFixture) -> KVCache:
    """The fixture's cache with one wave per layer: layer ``i`` is the ``i``-th region of every object."""
    region = fixture.kv.shards[0].layouts[0].regions[0].bytes_per_block
    return replace(fixture.kv, layer_waves={0: tuple(((layer * region, region),) for layer in range(LAYERS))})


async def _saved(store: MemoryStore, *, layer_seals: bool = True) -> tuple[KVFixture, LoadRequest]:
    """A request saved from a fresh cache (its writer leaving layer seals, unless not ``layer_seals``), and its load."""
    source = make_kv((FULL,), shards=2, layers=LAYERS, seed=0)
    saved = make_request(source.kv, 48)
    await run_save_path(_layered(source) if layer_seals else source.kv, store, [saved])
    request = LoadRequest("req-1", saved.block_hashes, (TARGET_BLOCKS,), 0, 48, layered=True)
    return source, request


class RangeRecorder:
    """Forwards every call to ``inner``; keeps each ranged get's keys and source offsets."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.ranged: list[tuple[list[str], list[list[int]]]] = []
        self.whole_object_keys: list[str] = []
        self.told: list[int] = []  # per layer told, how many objects had been read whole by then

    def batch_get_into_multi_buffer_ranges(self, keys, ptrs, sizes, offsets):  # type: ignore[no-untyped-def]
        self.ranged.append((list(keys), [list(o) for o in offsets]))
        return self.inner.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets)

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        self.whole_object_keys.extend(key for key in keys if is_object_key(key))
        return self.inner.batch_get_into_multi_buffers(keys, ptrs, sizes)

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self.inner, name)


async def _load(kv, store, request, layer_observer=None):  # type: ignore[no-untyped-def]
    failed: dict[str, frozenset[int]] = {}
    batch = batch_of([request])
    stage = LoadStage(
        LoadParams(),
        kv,
        store,
        lambda r, ids: failed.setdefault(r.request_id, ids),
        layer_observer=layer_observer,
    )
    try:
        await stage.process_batch(batch)
    finally:
        await stage.stop()
    return batch[0].emit, failed


def _first_key(fixture: KVFixture, request: LoadRequest) -> str:
    """The key of the request's first chunk in shard 0."""
    return object_key(fixture.kv.shards[0].namespace, 0, request.block_hashes[0])


def _write(store: MemoryStore, key: str, data: bytes) -> None:
    """Replace ``key``'s object with ``data``, as a buggy writer would."""
    store.remove(key, force=True)
    buffer = ctypes.create_string_buffer(data, len(data))
    config = store.new_replicate_config()
    assert store.batch_put_from_multi_buffers([key], [[ctypes.addressof(buffer)]], [[len(data)]], config) == [0]


def _block_layer(fixture: KVFixture, shard: int, layer: int, block: int) -> bytes:
    return bytes_of(fixture.tensors[(shard, 0)][layer][block])


async def test_a_layered_load_puts_every_layer_of_every_object_into_its_blocks() -> None:
    store = MemoryStore(lease_ttl_s=0)
    source, request = await _saved(store)
    target = make_kv((FULL,), shards=2, layers=LAYERS, seed=1)

    emit, failed = await _load(_layered(target), store, request)

    assert all(
        target.block_bytes(shard, 0, block) == source.block_bytes(shard, 0, 1 + chunk)
        for shard in range(2)
        for chunk, block in enumerate(TARGET_BLOCKS)
    )
    assert (emit.counts["loaded"], emit.counts["integrity_verified"], failed) == (6, 6, {"req-1": frozenset()})


async def test_each_ranged_get_reads_one_layer_of_every_object_in_layer_order() -> None:
    store = MemoryStore(lease_ttl_s=0)
    _, request = await _saved(store)
    recorder = RangeRecorder(store)
    target = make_kv((FULL,), shards=2, layers=LAYERS, seed=1)
    region = target.kv.shards[0].layouts[0].regions[0].bytes_per_block

    await _load(_layered(target), recorder, request)

    assert [len(keys) for keys, _ in recorder.ranged] == [6] * LAYERS
    assert [{tuple(o) for o in offsets} for _, offsets in recorder.ranged] == [
        {(layer * region,)} for layer in range(LAYERS)
    ]
    assert recorder.whole_object_keys == []  # only the seals are read whole


async def test_the_observer_hears_of_each_layer_once_its_bytes_are_in_the_blocks_and_before_the_next() -> None:
    store = MemoryStore(lease_ttl_s=0)
    source, request = await _saved(store)
    target = make_kv((FULL,), shards=2, layers=LAYERS, seed=1)
    seen: list[tuple[int, list[bool]]] = []

    def observed(landed: LoadRequest, wave: int) -> None:
        assert landed is request
        seen.append(
            (
                wave,
                [
                    _block_layer(target, 0, layer, TARGET_BLOCKS[0]) == _block_layer(source, 0, layer, 1)
                    for layer in range(LAYERS)
                ],
            )
        )

    await _load(_layered(target), store, request, observed)

    assert seen == [(0, [True, False, False]), (1, [True, True, False]), (2, [True, True, True])]


async def test_a_missing_object_fails_its_block_and_the_others_load() -> None:
    store = MemoryStore(lease_ttl_s=0)
    source, request = await _saved(store)
    assert store.remove(_first_key(source, request), force=True) == 0
    target = make_kv((FULL,), shards=2, layers=LAYERS, seed=1)

    emit, failed = await _load(_layered(target), store, request)

    assert (emit.counts["loaded"], emit.counts["failed"], len(failed["req-1"])) == (5, 1, 1)
    assert any("-704" in failure for failure in emit.failures)


async def test_a_layer_damaged_in_the_store_fails_its_block_at_that_layer_before_the_layer_is_told() -> None:
    store = MemoryStore(lease_ttl_s=0)
    source, request = await _saved(store)
    good = source.block_bytes(0, 0, 1)
    region = len(good) // LAYERS
    flipped = bytes(b ^ 0xFF for b in good[region : 2 * region])
    _write(store, _first_key(source, request), good[:region] + flipped + good[2 * region :])
    target = make_kv((FULL,), shards=2, layers=LAYERS, seed=1)

    emit, failed = await _load(_layered(target), store, request)

    assert (emit.counts["integrity_corrupt"], emit.counts["loaded"], len(failed["req-1"])) == (1, 5, 1)
    assert any("integrity: corrupt (layer 1)" in str(failure) for failure in emit.failures)
    assert store.batch_is_exist([_first_key(source, request)]) == [0]  # removed, with its seals


class FailsOneWave(RangeRecorder):
    """A store whose ranged get of ``key`` at source offset ``offset`` fails its transfer (-800)."""

    def __init__(self, inner: MemoryStore, key: str, offset: int) -> None:
        super().__init__(inner)
        self.failing = (key, offset)

    def batch_get_into_multi_buffer_ranges(self, keys, ptrs, sizes, offsets):  # type: ignore[no-untyped-def]
        codes = super().batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets)
        return [
            Code.TRANSFER_FAILED if (key, offset[0]) == self.failing else code
            for key, offset, code in zip(keys, offsets, codes, strict=True)
        ]


async def test_a_layer_the_store_fails_to_transfer_fails_its_block_and_the_others_load() -> None:
    store = MemoryStore(lease_ttl_s=0)
    source, request = await _saved(store)
    region = len(source.block_bytes(0, 0, 1)) // LAYERS
    key = _first_key(source, request)
    failing = FailsOneWave(store, key, region)  # its layer 1
    target = make_kv((FULL,), shards=2, layers=LAYERS, seed=1)

    emit, failed = await _load(_layered(target), failing, request)

    assert (emit.counts["loaded"], emit.counts["failed"], len(failed["req-1"])) == (5, 1, 1)
    assert any("-800" in failure for failure in emit.failures)
    assert [keys.count(key) for keys, _ in failing.ranged] == [1, 1, 0]  # no layer of it read after the failure
    assert store.batch_is_exist([key]) == [1]  # a failed transfer says nothing against the object


async def test_objects_sealed_without_layer_seals_are_read_whole_and_judged_before_the_first_layer() -> None:
    store = MemoryStore(lease_ttl_s=0)
    _, request = await _saved(store, layer_seals=False)
    recorder = RangeRecorder(store)
    target = make_kv((FULL,), shards=2, layers=LAYERS, seed=1)

    emit, _ = await _load(
        _layered(target), recorder, request, lambda _, wave: recorder.told.append(len(recorder.whole_object_keys))
    )

    assert recorder.ranged == []  # nothing left to read layer by layer
    assert recorder.told == [6] * LAYERS  # all six judged whole before the first layer was told
    assert (emit.counts["loaded"], emit.counts["integrity_verified"]) == (6, 6)


async def test_a_writer_that_knows_the_layers_leaves_a_layer_seal_beside_each_seal() -> None:
    store = MemoryStore(lease_ttl_s=0)
    source, request = await _saved(store)
    namespace = source.kv.shards[0].namespace
    anchor = object_key(namespace, 0, request.block_hashes[0])

    assert store.batch_is_exist([seal_key(anchor), layer_seal_key(anchor)]) == [1, 1]


async def test_a_load_that_is_not_layered_reads_whole_objects_though_the_cache_knows_its_layers() -> None:
    store = MemoryStore(lease_ttl_s=0)
    _, request = await _saved(store)
    recorder = RangeRecorder(store)
    target = make_kv((FULL,), shards=2, layers=LAYERS, seed=1)

    emit, _ = await _load(_layered(target), recorder, replace(request, layered=False))

    assert (recorder.ranged, len(recorder.whole_object_keys), emit.counts["loaded"]) == ([], 6, 6)


async def test_the_sessions_a_layered_load_opened_are_closed_when_it_ends() -> None:
    store = MemoryStore(lease_ttl_s=0)
    source, request = await _saved(store)
    target = make_kv((FULL,), shards=2, layers=LAYERS, seed=1)
    await _load(_layered(target), store, request)
    landing = ctypes.create_string_buffer(1)

    codes = store.batch_get_into_multi_buffer_ranges(
        [_first_key(source, request)], [[ctypes.addressof(landing)]], [[1]], [[0]]
    )

    assert codes == [Code.INVALID_PARAMS]


def test_a_range_across_two_buffers_becomes_two_pieces() -> None:
    buffers = [Buffer(1000, 8), Buffer(5000, 8)]

    assert wave_pieces(buffers, ((6, 4),)) == ([1006, 5000], [2, 2], [6, 8])


def test_a_range_past_the_object_is_refused() -> None:
    with pytest.raises(ValueError, match="outside an object of 16 bytes"):
        wave_pieces([Buffer(1000, 16)], ((12, 8),))


def test_a_key_is_closed_only_when_its_last_reader_leaves() -> None:
    sessions = GetSessions()
    sessions.joined(sessions.to_open(["k"]))
    assert sessions.to_open(["k", "j"]) == ["j"]
    sessions.joined(["k"])

    assert (sessions.left(["k"]), sessions.left(["k"])) == ([], ["k"])
