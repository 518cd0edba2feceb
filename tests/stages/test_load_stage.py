"""``load`` reads saved chunks back into the engine's blocks, and reports the blocks that failed.

A request is saved from one cache's memory with the real save stages, then
loaded into DIFFERENT blocks of a second cache (same ranks, fresh random
memory), so a loaded block can only hold the saved bytes if the load put them
there.
"""

import anyio
import pytest
from pydantic import ValidationError

from kvpipe.connector.store.memory import Faults, MemoryStore
from kvpipe.pipeline import BuildError, Outcome, Pipeline
from kvpipe.pipeline.registry import Resources
from kvpipe.pipeline.testing import batch_of
from kvpipe.stages import (
    KV_STAGES,
    GroupKind,
    GroupSpec,
    LoadParams,
    LoadRequest,
    LoadStage,
    default_load_graph,
    is_seal_key,
    object_key,
    storable_groups,
)
from kvpipe.stages.load_plan import load_chunks, load_slots, longest_load, touched_block_ids
from kvpipe.stages.retention import LoadedKeys

from .kv_fixtures import FULL, MAMBA_ALIGN, RING, WINDOW, bytes_of, make_kv, make_request
from .save_path import run_save_path
from .stores import ScriptedStore, StalledGets

HYBRID = (FULL, RING, MAMBA_ALIGN)
TWO_GROUPS = (FULL, RING, FULL)  # two stored groups around one that is not
TARGET_BLOCKS = (10, 11, 12)  # where the engine put the chunks saved from blocks 1, 2, 3


class GetRecorder:
    """Forwards gets to ``inner`` and keeps each call's keys and buffer sizes."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[list[str], list[list[int]]]] = []

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
        self.calls.append((list(keys), [list(s) for s in sizes]))
        return self.inner.batch_get_into_multi_buffers(keys, ptrs, sizes)

    def __getattr__(self, name):  # the rest of the store (seal memory registration, removal)
        return getattr(self.inner, name)

    @property
    def object_keys(self):
        """Each call's keys but the seals read beside them."""
        return [[key for key in keys if not is_seal_key(key)] for keys, _ in self.calls]

    @property
    def buffers_per_call(self):
        return [sum(len(s) for s in sizes) for _, sizes in self.calls]


async def _saved(groups=TWO_GROUPS, *, shards=2, tokens=48, store=None):
    """The source cache, a store holding ``tokens`` of its request, and the request."""
    source = make_kv(groups, shards=shards, seed=0)
    store = MemoryStore(lease_ttl_s=0) if store is None else store
    saved = make_request(source.kv, tokens)
    await run_save_path(source.kv, store, [saved])
    return source, store, saved


def _load_request(saved, start=0, end=48, blocks=TARGET_BLOCKS, request_id="req-1"):
    return LoadRequest(request_id, saved.block_hashes, tuple(blocks for _ in saved.block_ids), start, end)


async def _load(kv, store, *requests, **params):
    failed_blocks: dict[str, frozenset[int]] = {}
    batch = batch_of(requests)
    stage = LoadStage(LoadParams(**params), kv, store, lambda request, ids: failed_blocks.setdefault(request.request_id, ids))
    try:
        await stage.process_batch(batch)
    finally:  # its seal memory is unregistered: the store outlives the stage
        await stage.stop()
    return [entry.emit for entry in batch], failed_blocks


def _moved(source, target, *, groups, shards, chunks=range(3), blocks=TARGET_BLOCKS):
    """Whether each chunk's block holds in ``target`` what it held in ``source``."""
    return {
        (shard, group, chunk): target.block_bytes(shard, group, blocks[chunk])
        == source.block_bytes(shard, group, 1 + chunk)
        for shard in range(shards)
        for group in groups
        for chunk in chunks
    }


async def test_load_puts_the_saved_bytes_into_other_blocks_of_fresh_memory():
    source, store, saved = await _saved()
    target = make_kv(TWO_GROUPS, shards=2, seed=1)
    ring_before = [bytes_of(layer) for shard in range(2) for layer in target.tensors[(shard, 1)]]

    (emit,), failed = await _load(target.kv, store, _load_request(saved))

    assert all(_moved(source, target, groups=(0, 2), shards=2).values())  # every layer, shard, group
    assert [bytes_of(layer) for shard in range(2) for layer in target.tensors[(shard, 1)]] == ring_before
    assert (emit.counts["loaded"], emit.succeeded_units, emit.failures) == (3 * 2 * 2, 12, [])
    assert failed == {"req-1": frozenset()}


async def test_a_mamba_group_loads_one_state_the_one_at_the_end_of_the_range():
    source, store, saved = await _saved(HYBRID, tokens=48)  # the state at 48, every attention chunk
    target = make_kv(HYBRID, shards=2, seed=1)

    (emit,), failed = await _load(target.kv, store, _load_request(saved, start=16, end=48))

    assert _moved(source, target, groups=(0,), shards=2, chunks=(1, 2)) == dict.fromkeys(
        ((shard, 0, chunk) for shard in range(2) for chunk in (1, 2)), True
    )
    assert _moved(source, target, groups=(2,), shards=2) == {
        (shard, 2, chunk): chunk == 2 for shard in range(2) for chunk in range(3)
    }
    assert (emit.counts["loaded"], failed) == ((2 + 1) * 2, {"req-1": frozenset()})


async def test_a_sliding_window_group_loads_only_the_blocks_its_window_reads_past_the_range():
    """At 48 tokens a window of 24 reads tokens 25..47: blocks 1 and 2. The engine lists its null
    block for block 0, so nothing is written there and it is no block of the load's to fail."""
    groups = (FULL, WINDOW)
    source, store, saved = await _saved(groups, shards=1)
    target = make_kv(groups, shards=1, seed=1)
    null_before = target.block_bytes(0, 1, 0)
    load = LoadRequest("req-1", saved.block_hashes, (TARGET_BLOCKS, (0, 11, 12)), 0, 48)

    (emit,), failed = await _load(target.kv, store, load)

    assert _moved(source, target, groups=(1,), shards=1, blocks=(0, 11, 12)) == {
        (0, 1, 0): False,
        (0, 1, 1): True,
        (0, 1, 2): True,
    }
    assert target.block_bytes(0, 1, 0) == null_before
    assert emit.counts["loaded"] == 3 + 2
    assert touched_block_ids(storable_groups(target.kv), load) == {10, 11, 12}
    assert failed == {"req-1": frozenset()}


async def test_only_the_chunks_from_start_to_end_are_loaded():
    source, store, saved = await _saved([FULL], shards=1)
    target = make_kv([FULL], shards=1, seed=1)

    (emit,), _ = await _load(target.kv, store, _load_request(saved, start=16, end=48))

    assert _moved(source, target, groups=(0,), shards=1) == {
        (0, 0, 0): False,
        (0, 0, 1): True,
        (0, 0, 2): True,
    }
    assert emit.counts["loaded"] == 2


async def test_a_missing_object_fails_its_record_and_reports_its_block_while_the_rest_load():
    source, store, saved = await _saved([FULL], shards=2)
    missing = object_key(source.kv.shards[1].namespace, 0, saved.block_hashes[1])
    assert store.remove(missing) == 0
    target = make_kv([FULL], shards=2, seed=1)

    (emit,), failed = await _load(target.kv, store, _load_request(saved))

    assert emit.failures == [f"load {missing}: -704 (NOT_FOUND)"]
    assert (emit.counts["failed"], emit.counts["loaded"]) == (1, 5)
    assert failed == {"req-1": frozenset({TARGET_BLOCKS[1]})}
    moved = _moved(source, target, groups=(0,), shards=2)
    assert [key for key, ok in moved.items() if not ok] == [(1, 0, 1)]


async def test_every_object_loaded_whole_and_only_those_are_told_to_the_loaded_keys():
    source, store, saved = await _saved([FULL], shards=2)
    missing = object_key(source.kv.shards[1].namespace, 0, saved.block_hashes[1])
    assert store.remove(missing) == 0
    target = make_kv([FULL], shards=2, seed=1)
    loads = LoadedKeys()
    stage = LoadStage(LoadParams(), target.kv, store, loads=loads)

    await stage.process_batch(batch_of([_load_request(saved)]))
    await stage.stop()

    expected = {
        object_key(source.kv.shards[shard].namespace, 0, chunk_hash)
        for shard in range(2)
        for chunk_hash in saved.block_hashes[:3]
    } - {missing}
    assert sorted(loads.take()) == sorted(expected)


@pytest.mark.parametrize(("layers", "code"), [(1, "-600 (INVALID_PARAMS)"), (3, "-800 (TRANSFER_FAILED)")])
async def test_a_destination_of_the_wrong_size_fails_every_record_it_receives(layers, code):
    _, store, saved = await _saved([FULL], shards=1)
    target = make_kv([FULL], shards=1, layers=layers, seed=1)  # a block of other size than the object

    (emit,), failed = await _load(target.kv, store, _load_request(saved))

    assert emit.counts["failed"] == 3 and emit.counts["loaded"] == 0
    assert all(str(failure).endswith(code) for failure in emit.failures)
    assert failed == {"req-1": frozenset(TARGET_BLOCKS)}


async def test_a_read_of_the_wrong_byte_count_is_a_failed_load_not_a_partial_success():
    kv = make_kv([FULL], shards=1).kv
    store = ScriptedStore()
    store.batch_get_into_multi_buffers = lambda keys, ptrs, sizes: [sum(s) - 1 for s in sizes]
    saved = make_request(kv, 16)

    (emit,), failed = await _load(kv, store, _load_request(saved, end=16))

    (failure,) = emit.failures
    assert failure.endswith("read 1023 bytes, the block holds 1024")
    assert (emit.succeeded_units, failed) == (0, {"req-1": frozenset({TARGET_BLOCKS[0]})})


async def test_a_store_call_that_raises_fails_every_record_of_the_call():
    kv = make_kv([FULL], shards=1).kv
    store = ScriptedStore()

    def broken(keys, ptrs, sizes):
        raise RuntimeError("connection reset")

    store.batch_get_into_multi_buffers = broken

    (emit,), failed = await _load(kv, store, _load_request(make_request(kv, 48)))

    assert emit.failed_units == 3
    assert "store call raised RuntimeError: connection reset" in str(emit.failures[0])
    assert failed == {"req-1": frozenset(TARGET_BLOCKS)}


async def test_store_errors_fail_their_records_with_the_code_named():
    _, store, saved = await _saved([FULL], shards=1)
    store.faults = Faults(error_rates={"get": {-800: 1.0}})
    target = make_kv([FULL], shards=1, seed=1)

    (emit,), _ = await _load(target.kv, store, _load_request(saved))

    assert emit.counts["failed"] == 3
    assert all(str(failure).endswith("-800 (TRANSFER_FAILED)") for failure in emit.failures)


async def test_one_get_call_serves_every_request_of_the_batch():
    source = make_kv([FULL], shards=1, seed=0)
    store = MemoryStore()
    first, second = make_request(source.kv, 32, request_id="a"), make_request(source.kv, 16, request_id="b")
    await run_save_path(source.kv, store, [first, second])
    target = make_kv([FULL], shards=1, seed=1)
    recording = GetRecorder(store)

    emits, failed = await _load(
        target.kv,
        recording,
        _load_request(first, end=32, request_id="a"),
        _load_request(second, end=16, blocks=(13,), request_id="b"),
    )

    assert [len(keys) for keys in recording.object_keys] == [3]
    assert [emit.counts["loaded"] for emit in emits] == [2, 1]
    assert failed == {"a": frozenset(), "b": frozenset()}


@pytest.mark.parametrize(
    ("integrity", "budget", "buffers"),
    [("off", 10, 8), ("verify", 12, 12)],  # with seals, each of a chunk's 4 objects reads one more
)
async def test_calls_stay_within_the_buffer_budget_and_keep_a_chunk_together(integrity, budget, buffers):
    source, store, saved = await _saved(TWO_GROUPS, shards=2)  # a chunk: 2 groups x 2 shards x 2 layers
    target = make_kv(TWO_GROUPS, shards=2, seed=1)
    recording = GetRecorder(store)

    (emit,), _ = await _load(
        target.kv, recording, _load_request(saved), max_buffers_per_call=budget, integrity=integrity
    )

    assert recording.buffers_per_call == [buffers] * 3
    assert [{key.rsplit("@", 1)[1] for key in keys} for keys in recording.object_keys] == [
        {h.hex()} for h in saved.block_hashes
    ]
    assert emit.counts["loaded"] == 12 and all(_moved(source, target, groups=(0, 2), shards=2).values())


@pytest.mark.parametrize(
    ("integrity", "budget", "message"),
    [
        ("off", 1, "2 buffers exceed max_buffers_per_call=1; not sent"),
        ("verify", 2, "3 buffers exceed max_buffers_per_call=2; not sent"),  # its seal is one more
    ],
)
async def test_a_record_over_the_budget_on_its_own_fails_without_being_sent(integrity, budget, message):
    _, store, saved = await _saved([FULL], shards=1)  # 2 layers: 2 buffers per record
    recording = GetRecorder(store)

    (emit,), failed = await _load(
        make_kv([FULL], seed=1).kv,
        recording,
        _load_request(saved),
        max_buffers_per_call=budget,
        integrity=integrity,
    )

    assert recording.calls == []
    assert emit.counts["failed"] == 3
    assert message in str(emit.failures[0])
    assert failed == {"req-1": frozenset(TARGET_BLOCKS)}


async def test_two_requests_loading_the_same_chunk_never_share_a_call_but_both_load():
    source, store, saved = await _saved([FULL], shards=1, tokens=16)
    target = make_kv([FULL], shards=1, seed=1)
    recording = GetRecorder(store)

    emits, _ = await _load(
        target.kv,
        recording,
        _load_request(saved, end=16, blocks=(10,), request_id="a"),
        _load_request(saved, end=16, blocks=(11,), request_id="b"),
    )

    assert [len(keys) for keys in recording.object_keys] == [1, 1]
    assert [emit.counts["loaded"] for emit in emits] == [1, 1]
    assert target.block_bytes(0, 0, 10) == target.block_bytes(0, 0, 11) == source.block_bytes(0, 0, 1)


@pytest.mark.parametrize(
    ("start", "end", "message"),
    [
        (0, 40, "end_tokens 40 is not a multiple of hash_block_size 16"),
        (8, 48, "start_tokens 8 is not a multiple of block_size 16"),
        (0, 64, "end_tokens 64 is beyond the 3 hash blocks"),
    ],
)
async def test_a_range_that_does_not_fit_the_cache_fails_the_request_and_reports_its_blocks(
    start, end, message
):
    kv = make_kv([FULL]).kv
    recording = GetRecorder(ScriptedStore())

    (emit,), failed = await _load(kv, recording, _load_request(make_request(kv, 48), start, end))

    assert recording.calls == []
    assert message in str(emit.failures[0])
    assert failed["req-1"] <= frozenset(TARGET_BLOCKS) and failed["req-1"]


def test_a_load_names_as_its_blocks_only_those_it_would_fill_never_the_null_blocks_below_a_state_or_a_window():
    """What an invalid load fails: the engine lists its null block (0) before a mamba state and
    below a window, and every such request shares it."""
    groups = storable_groups(make_kv([FULL, MAMBA_ALIGN, WINDOW]).kv)
    load = LoadRequest("r", (), ((10, 11, 12), (0, 0, 21), (0, 31, 32)), 0, 48)

    assert touched_block_ids(groups, load) == {10, 11, 12, 21, 31, 32}


def test_the_longest_load_takes_a_slot_per_block_of_each_group_and_one_per_recurrent_state():
    hybrid = storable_groups(make_kv([FULL, RING, MAMBA_ALIGN]).kv)  # 16-token blocks; a ring is not stored
    mixed = storable_groups(make_kv([FULL, GroupSpec(GroupKind.FULL_ATTENTION, block_size=32)]).kv)

    assert longest_load(hybrid, 5) == 64  # four blocks and the state at their end
    assert longest_load(mixed, 6) == 64  # four 16-token blocks and two 32-token ones
    assert longest_load(mixed, 1) == 0


def test_a_load_through_a_window_takes_a_few_slots_however_far_it_reaches():
    """A window of 24 tokens reads at most 3 blocks of 16 (23 tokens, and the block the end lies in)."""
    windowed = storable_groups(make_kv([WINDOW]).kv)
    hybrid = storable_groups(make_kv([WINDOW, MAMBA_ALIGN]).kv)

    assert max(load_slots(windowed, 0, end) for end in range(1, 4000)) == 3
    assert longest_load(windowed, 3) is None
    assert longest_load(hybrid, 4) is None
    assert longest_load(hybrid, 3) is not None


def test_a_load_through_local_attention_chunks_takes_the_blocks_of_one_chunk_and_one_more_at_most():
    """Local chunks of 33 tokens read at most 32 tokens back: 2 blocks of 16 and the end's own."""
    local = storable_groups(make_kv([GroupSpec(GroupKind.FULL_ATTENTION, block_size=16, attention_chunk=33)]).kv)

    assert max(load_slots(local, 0, end) for end in range(1, 4000)) == 3
    assert longest_load(local, 3) is None
    assert longest_load(local, 2) is not None


def test_a_load_takes_a_slot_per_chunk_it_loads():
    kv = make_kv([FULL, RING, MAMBA_ALIGN, GroupSpec(GroupKind.FULL_ATTENTION, block_size=32), WINDOW]).kv
    groups, request = storable_groups(kv), make_request(kv, 96)

    for start, end in [(0, 96), (32, 96), (0, 80), (64, 80), (0, 16), (64, 96)]:
        load = LoadRequest("r", request.block_hashes, request.block_ids, start, end)
        assert load_slots(groups, start, end) == len(load_chunks(groups, kv.hash_block_size, load))


def test_a_load_request_refuses_a_range_that_ends_before_it_starts():
    with pytest.raises(ValueError, match="start_tokens=32, end_tokens=16"):
        LoadRequest("r", (), ((),), 32, 16)


async def test_an_empty_range_loads_nothing_and_is_dropped():
    kv = make_kv([FULL]).kv
    recording = GetRecorder(ScriptedStore())

    (emit,), failed = await _load(kv, recording, _load_request(make_request(kv, 48), 16, 16))

    assert recording.calls == [] and emit.dropped == ["no chunk to load"]
    assert failed == {"req-1": frozenset()}


async def test_the_default_load_graph_loads_and_ends_each_job_with_its_outcome():
    source, store, saved = await _saved(TWO_GROUPS, shards=2)
    assert store.remove(object_key(source.kv.shards[0].namespace, 1, saved.block_hashes[2])) == 0
    target = make_kv(TWO_GROUPS, shards=2, seed=1)
    failed: dict[str, frozenset[int]] = {}
    graph = default_load_graph(target.kv, store, lambda request, ids: failed.update({request.request_id: ids}))

    async with Pipeline(graph) as pipeline:
        whole = await pipeline.submit(_load_request(saved, end=32, request_id="whole"))
        holed = await pipeline.submit(_load_request(saved, blocks=(13, 14, 15), request_id="holed"))
        done = [await job.finished() for job in (whole, holed)]

    assert [(job.outcome, job.counts["loaded"], job.counts["failed"]) for job in done] == [
        (Outcome.OK, 8, 0),
        (Outcome.PARTIAL, 11, 1),
    ]
    assert failed == {"whole": frozenset(), "holed": frozenset({15})}


async def test_a_load_whose_store_call_hangs_holds_no_later_load():
    """A read from a node cut off by the network hangs (Mooncake bounds no connect): one worker waits, not all."""
    source, store, saved = await _saved(TWO_GROUPS, shards=2, store=StalledGets())
    target = make_kv(TWO_GROUPS, shards=2, seed=1)

    async with Pipeline(default_load_graph(target.kv, store)) as pipeline:
        try:
            with anyio.fail_after(10):
                stuck = await pipeline.submit(_load_request(saved, request_id="stuck"))
                while not store.hanging:
                    await anyio.sleep(0.01)
                later = await pipeline.submit(_load_request(saved, blocks=(13, 14, 15), request_id="later"))
                done = await later.finished()
            assert not stuck.done
        finally:
            store.let_go.set()

    assert (done.outcome, done.counts["loaded"], done.counts["failed"]) == (Outcome.OK, 12, 0)


def test_load_params_refuse_unknown_fields_and_a_budget_below_1():
    with pytest.raises(ValidationError, match="max_buffers"):
        KV_STAGES["load"].params.model_validate({"max_buffers": 4})
    with pytest.raises(ValidationError, match="max_buffers_per_call"):
        KV_STAGES["load"].params.model_validate({"max_buffers_per_call": 0})


def test_the_load_stage_needs_a_store_that_can_read_into_buffers():
    stage_type = KV_STAGES["load"]
    resources = Resources({"kv": make_kv().kv, "store": object()})

    with pytest.raises(BuildError, match="resource 'store' must be a LoadingStore"):
        stage_type.build(LoadParams(), resources)


async def test_a_partial_hit_loads_its_last_block_whole_from_the_tail_stored_where_it_ends():
    source = make_kv([FULL], shards=1, seed=0, hash_block_size=8)
    store = MemoryStore(lease_ttl_s=0)
    saved = make_request(source.kv, 40, finished=True)  # chunks 0-1 and the tail 32-40 of block 3
    await run_save_path(source.kv, store, [saved])
    target = make_kv([FULL], shards=1, seed=1, hash_block_size=8)

    (emit,), failed = await _load(target.kv, store, _load_request(saved, end=40))

    assert (emit.counts["loaded"], failed) == (3, {"req-1": frozenset()})
    assert all(_moved(source, target, groups=(0,), shards=1).values())  # blocks 1, 2 and the tail's block 3


async def test_a_block_a_hit_cuts_loads_whole_from_the_object_the_lookup_named_in_that_block():
    """An object of a block holds the block's shorter prefixes too: a hit of 24 tokens whose cut block
    (tokens 16-32, saved from block 2) the lookup found whole loads that object, not a tail at 24."""
    source = make_kv([FULL], shards=1, seed=0, hash_block_size=8)
    store = GetRecorder(MemoryStore(lease_ttl_s=0))
    saved = make_request(source.kv, 40, finished=True)  # chunks 0-1 and the tail 32-40 of block 3
    await run_save_path(source.kv, store, [saved])
    target = make_kv([FULL], shards=1, seed=1, hash_block_size=8)
    request = _load_request(saved, end=24)
    request = LoadRequest(request.request_id, request.block_hashes, request.block_ids, 0, 24, ((0, 32),))

    (emit,), failed = await _load(target.kv, store, request)

    assert (emit.counts["loaded"], failed) == (2, {"req-1": frozenset()})
    namespace = source.kv.shards[0].namespace
    assert store.object_keys == [[object_key(namespace, 0, saved.block_hashes[i]) for i in (1, 3)]]
    assert all(_moved(source, target, groups=(0,), shards=1, chunks=range(2)).values())
