"""A lookup's hit is the prefix whose chunks are stored for every group and shard.

Requests are saved with the real save stages into a MemoryStore, then looked up
as the scheduler looks them up (a :class:`LookupPlan`'s keys, the store's
answers, the plan's hit); objects are taken away with ``store.remove`` to
make holes.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.stages import (
    EXISTS,
    GroupKind,
    GroupSpec,
    LookupPlan,
    LookupRequest,
    object_key,
    storable_groups,
)

from .kv_fixtures import FULL, MAMBA_ALIGN, RING, WINDOW, make_kv, make_request
from .save_path import run_save_path
from .stores import ScriptedStore

BIG = GroupSpec(GroupKind.FULL_ATTENTION, block_size=32)


async def _saved(kv, tokens, **request):
    """A store holding ``tokens`` tokens of a request (leases off, so objects can be removed)."""
    store = MemoryStore(lease_ttl_s=0)
    saved = make_request(kv, tokens, **request)
    await run_save_path(kv, store, [saved])
    return store, saved


def _asking(saved, num_tokens, num_computed_tokens=0):
    return LookupRequest(saved.request_id, saved.block_hashes, num_tokens, num_computed_tokens)


def _key(kv, chunk, *, shard=0, store_group=0):
    """The key of a chunk of a 16-token-block group saved by ``make_request(request_id="req-1")``."""
    hashes = make_request(kv, 16 * (chunk + 1)).block_hashes
    return object_key(kv.shards[shard].namespace, store_group, hashes[chunk])


def _answers(store, keys):
    """What the store says of each key: stored, or not (an error code is "don't know": a miss)."""
    return {key: answer == EXISTS for key, answer in zip(keys, store.batch_is_exist(list(keys)), strict=True)}


def _plan(kv, request):
    return LookupPlan(storable_groups(kv), kv.shards, kv.hash_block_size, request, kv.hit_alignment)


def _keys(kv, request):
    return _plan(kv, request).keys


def _hit(kv, store, request):
    """The hit of ``request``: the longest prefix the store's answers for its lookup keys hold."""
    plan = _plan(kv, request)
    return plan.hit(_answers(store, plan.keys))


async def test_the_hit_is_the_stored_prefix_counted_from_token_0():
    kv = make_kv([FULL], shards=2).kv
    store, saved = await _saved(kv, 48)

    assert _hit(kv, store, _asking(saved, num_tokens=100)) == 48


async def test_a_sliding_window_group_needs_only_the_blocks_its_window_reads_past_the_hit():
    """At 64 tokens a window of 24 reads blocks 2 and 3: its blocks 0 and 1 are not needed."""
    kv = make_kv([FULL, WINDOW]).kv
    store, saved = await _saved(kv, 64)
    for chunk in (0, 1):
        assert store.remove(_key(kv, chunk, store_group=1)) == 0

    assert _hit(kv, store, _asking(saved, num_tokens=100)) == 64


async def test_a_block_missing_inside_a_sliding_window_ends_the_hit_before_it():
    kv = make_kv([FULL, WINDOW]).kv
    store, saved = await _saved(kv, 64)
    assert store.remove(_key(kv, 3, store_group=1)) == 0

    assert _hit(kv, store, _asking(saved, num_tokens=100)) == 48  # reads blocks 1 and 2


async def test_a_chunk_missing_for_one_shard_ends_the_hit_there():
    kv = make_kv([FULL], shards=2).kv
    store, saved = await _saved(kv, 64)
    assert store.remove(_key(kv, 2, shard=1)) == 0

    assert _hit(kv, store, _asking(saved, num_tokens=100)) == 32


async def test_a_chunk_missing_for_one_storable_group_ends_the_hit_there():
    kv = make_kv([FULL, RING, FULL], shards=2).kv
    store, saved = await _saved(kv, 64)
    assert store.remove(_key(kv, 1, shard=0, store_group=1)) == 0  # the second group's chunk 1

    assert _hit(kv, store, _asking(saved, num_tokens=100)) == 16


async def _saved_in_steps(kv, *steps):
    """A store holding a request saved at the end of each step (a mamba state at each step's end)."""
    store = MemoryStore(lease_ttl_s=0)
    saved, done = None, 0
    for tokens in steps:
        saved = make_request(kv, tokens, saved=done)
        await run_save_path(kv, store, [saved])
        done = tokens
    return store, saved


async def test_a_hit_ends_where_the_mamba_state_is_stored():
    kv = make_kv([FULL, RING, MAMBA_ALIGN], shards=2).kv
    store, saved = await _saved_in_steps(kv, 32, 64)  # states at 32 and 64; attention chunks 0-3

    assert _hit(kv, store, _asking(saved, num_tokens=100)) == 64


async def test_without_the_mamba_state_at_its_end_a_prefix_falls_back_to_an_earlier_state():
    kv = make_kv([FULL, RING, MAMBA_ALIGN], shards=2).kv
    store, saved = await _saved_in_steps(kv, 32, 64)
    assert store.remove(_key(kv, 3, shard=1, store_group=1)) == 0  # one rank's state at 64

    assert _hit(kv, store, _asking(saved, num_tokens=100)) == 32


async def test_a_prefix_without_any_mamba_state_is_a_miss():
    kv = make_kv([FULL, RING, MAMBA_ALIGN]).kv
    store, saved = await _saved_in_steps(kv, 40)  # 40 ends inside a block: no state is stored

    assert _hit(kv, store, _asking(saved, num_tokens=100)) == 0


async def test_a_chunk_stored_after_a_missing_one_does_not_count():
    kv = make_kv([FULL]).kv
    store, saved = await _saved(kv, 64)
    assert store.remove(_key(kv, 1)) == 0  # chunks 2 and 3 stay

    assert _hit(kv, store, _asking(saved, num_tokens=100)) == 16


async def test_the_ring_buffer_group_is_never_asked_for():
    kv = make_kv([FULL, RING, MAMBA_ALIGN], shards=2).kv
    store, saved = await _saved(kv, 32)
    request = _asking(saved, num_tokens=100)

    keys = _keys(kv, request)

    assert {key.split("@group:")[1][0] for key in keys} == {"0", "1"}  # store groups of FULL and MAMBA
    assert len(keys) == 2 * 2 * 2  # chunks x storable groups x shards
    assert _hit(kv, store, request) == 32


async def test_an_exist_error_code_is_a_miss():
    kv = make_kv([FULL], shards=2).kv
    store, saved = await _saved(kv, 48)
    failing = _key(kv, 1, shard=1)
    scripted = ScriptedStore(exist=lambda key: -900 if key == failing else store.batch_is_exist([key])[0])

    assert _hit(kv, scripted, _asking(saved, num_tokens=100)) == 16


async def test_the_hit_always_leaves_the_last_token_to_compute():
    kv = make_kv([FULL]).kv
    store, saved = await _saved(kv, 64)

    hits = [_hit(kv, store, _asking(saved, num_tokens=n)) for n in (64, 65, 49, 1, 0)]

    assert hits == [48, 64, 48, 0, 0]


async def test_a_hit_stops_at_what_one_load_may_bring_and_nothing_past_it_is_asked_for():
    kv = make_kv([FULL]).kv
    store, saved = await _saved(kv, 64)
    request = LookupRequest(saved.request_id, saved.block_hashes, 100, 16, max_load_tokens=40)

    assert _keys(kv, request) == (_key(kv, 1), _key(kv, 2))  # up to 16 + 40, whole chunks
    assert _hit(kv, store, request) == 48


async def test_a_hit_bounded_by_the_load_ends_where_the_mamba_state_is_stored_within_it():
    kv = make_kv([FULL, RING, MAMBA_ALIGN]).kv
    store, saved = await _saved_in_steps(kv, 32, 64)  # states at 32 and 64

    bounded = LookupRequest(saved.request_id, saved.block_hashes, 100, max_load_tokens=63)

    assert _hit(kv, store, bounded) == 32


async def test_chunks_the_engine_has_locally_are_not_asked_for_but_count_in_the_hit():
    kv = make_kv([FULL]).kv
    store, saved = await _saved(kv, 64)
    request = _asking(saved, num_tokens=100, num_computed_tokens=32)

    assert _keys(kv, request) == (_key(kv, 2), _key(kv, 3))
    assert _hit(kv, store, request) == 64


def test_groups_of_different_block_sizes_hit_only_where_both_groups_have_whole_chunks():
    kv = make_kv([FULL, BIG]).kv  # 16- and 32-token blocks: hits grow by 32 tokens
    groups = storable_groups(kv)
    hashes = make_request(kv, 128).block_hashes
    request = LookupRequest("r", hashes, num_tokens=200)
    stored = {object_key(kv.shards[0].namespace, 0, h) for h in hashes[:3]}  # 16-token chunks to 48
    stored |= {object_key(kv.shards[0].namespace, 1, h) for h in (hashes[1], hashes[3])}  # 32-token, to 64
    plan = LookupPlan(groups, kv.shards, kv.hash_block_size, request)
    exists = {key: key in stored for key in plan.keys}

    hit = plan.hit(exists)

    assert hit == 32  # both groups reach 48, but 48 would end inside a 32-token chunk


# -- the definition, checked on random holes ---------------------------------------------------

PROPERTY_KV = make_kv([FULL, BIG], shards=2, num_blocks=1).kv
PROPERTY_GROUPS = storable_groups(PROPERTY_KV)


@settings(max_examples=200, deadline=None)
@given(
    hashed_blocks=st.integers(0, 10),
    num_tokens=st.integers(0, 200),
    num_computed=st.integers(0, 200),
    data=st.data(),
)
def test_the_hit_is_the_longest_prefix_of_whole_units_stored_everywhere(
    hashed_blocks, num_tokens, num_computed, data
):
    hashes = make_request(PROPERTY_KV, 16 * hashed_blocks).block_hashes
    request = LookupRequest("r", hashes, num_tokens, num_computed)
    plan = LookupPlan(PROPERTY_GROUPS, PROPERTY_KV.shards, 16, request)
    exists = {key: data.draw(st.booleans(), label=key) for key in plan.keys}

    hit = plan.hit(exists)

    def whole(tokens):
        """Every chunk of every group below ``tokens`` is local or stored by every shard."""
        for group in PROPERTY_GROUPS:
            size = group.spec.block_size
            for index in range(tokens // size):
                if (index + 1) * size <= num_computed:
                    continue
                chunk_hash = hashes[(index + 1) * size // 16 - 1]
                if not all(
                    exists[object_key(s.namespace, group.store_group, chunk_hash)] for s in PROPERTY_KV.shards
                ):
                    return False
        return True

    assert hit % 32 == 0 and (hit < num_tokens or hit == 0) and hit <= 16 * hashed_blocks
    assert whole(hit)
    longer = hit + 32
    assert longer >= num_tokens or longer > 16 * hashed_blocks or not whole(longer)


# -- partial hits: an engine that hashes finer than its blocks -----------------------------------


def _partial_kv(groups=(FULL,)):
    return make_kv(list(groups), hash_block_size=8).kv


async def test_with_partial_hits_a_hit_may_end_inside_a_block_where_its_tail_is_stored():
    kv = _partial_kv()
    store = MemoryStore(lease_ttl_s=0)
    saved = make_request(kv, 40, finished=True)  # chunks 0-1, and the tail 32-40 of block 2
    await run_save_path(kv, store, [saved])
    groups, request = storable_groups(kv), _asking(saved, num_tokens=100)
    partial = LookupPlan(groups, kv.shards, 8, request, alignment=8)
    exists = _answers(store, partial.keys)

    assert partial.hit(exists) == 40
    assert LookupPlan(groups, kv.shards, 8, request).hit(exists) == 32  # whole blocks only


async def test_a_partial_hit_of_a_hybrid_needs_the_mamba_state_where_it_ends():
    kv = _partial_kv((FULL, RING, MAMBA_ALIGN))
    store = MemoryStore(lease_ttl_s=0)
    await run_save_path(kv, store, [make_request(kv, 32)])  # a step ended at 32: the state at 32
    saved = make_request(kv, 40, saved=32, finished=True)  # the next at 40: the state at 40, the tail
    await run_save_path(kv, store, [saved])
    groups, request = storable_groups(kv), _asking(saved, num_tokens=100)
    plan = LookupPlan(groups, kv.shards, 8, request, alignment=8)

    assert plan.hit(_answers(store, plan.keys)) == 40
    assert store.remove(object_key(kv.shards[0].namespace, 1, saved.block_hashes[4])) == 0  # the state at 40
    exists = _answers(store, plan.keys)
    assert plan.hit(exists) == 32  # the state at 32


async def test_a_partial_hit_may_end_inside_a_stored_block_and_loads_that_block_whole():
    """A block's object holds every shorter prefix of its block: with the mamba state at 40 and block 2
    (tokens 32-48) stored whole, a hit ends at 40 with no tail there, its block 2 loaded from the block's."""
    kv = _partial_kv((FULL, RING, MAMBA_ALIGN))
    store = MemoryStore(lease_ttl_s=0)
    await run_save_path(kv, store, [make_request(kv, 40, finished=True)])  # chunks 0-1, tail and state at 40
    saved = make_request(kv, 48, saved=40)  # a later request to 48: block 2, the state at 48
    await run_save_path(kv, store, [saved])
    namespace = kv.shards[0].namespace
    assert store.remove(object_key(namespace, 0, saved.block_hashes[4])) == 0  # the tail at 40
    assert store.remove(object_key(namespace, 1, saved.block_hashes[5])) == 0  # the state at 48
    groups, request = storable_groups(kv), _asking(saved, num_tokens=100)
    plan = LookupPlan(groups, kv.shards, 8, request, alignment=8)
    exists = _answers(store, plan.keys)

    hit = plan.hit(exists)

    assert hit == 40
    assert plan.cut_block_sources(exists, hit) == ((0, 48),)


# -- an engine that recomputes the last block of a hit (EAGLE, MTP) -------------------------------


def _recomputing(kv, request, alignment=None):
    return LookupPlan(storable_groups(kv), kv.shards, kv.hash_block_size, request, alignment, recomputes_last_block=True)


async def test_an_engine_that_recomputes_a_hits_last_block_hits_one_block_short_of_what_is_stored():
    kv = make_kv([FULL]).kv
    store, saved = await _saved(kv, 64)
    plan = _recomputing(kv, _asking(saved, num_tokens=100))

    assert plan.hit(_answers(store, plan.keys)) == 48


async def test_groups_of_several_kinds_look_for_the_recomputed_block_past_the_longest_hit_allowed():
    """vLLM's rule for hybrids: the block to recompute may lie past ``num_tokens - 1``; a single kind's may not."""
    hybrid = make_kv([FULL, WINDOW]).kv
    store, saved = await _saved(hybrid, 64)
    plan = _recomputing(hybrid, _asking(saved, num_tokens=64))

    assert plan.hit(_answers(store, plan.keys)) == 48  # 48 + 16 is stored, though past the 63 allowed
    single = make_kv([FULL]).kv
    store, saved = await _saved(single, 64)
    plan = _recomputing(single, _asking(saved, num_tokens=64))
    assert plan.hit(_answers(store, plan.keys)) == 32


async def test_with_partial_hits_the_recomputed_part_is_one_hash_block_and_the_cut_block_loads_from_past_it():
    kv = _partial_kv()
    store = MemoryStore(lease_ttl_s=0)
    await run_save_path(kv, store, [make_request(kv, 40, finished=True)])  # chunks 0-1, the tail at 40
    plan = _recomputing(kv, _asking(make_request(kv, 64), num_tokens=100), alignment=8)
    exists = _answers(store, plan.keys)

    assert plan.hit(exists) == 32
    await run_save_path(kv, store, [make_request(kv, 48)])  # block 2 whole: a hit of 40 loads it
    exists = _answers(store, plan.keys)
    assert plan.hit(exists) == 40
    assert plan.cut_block_sources(exists, 40) == ((0, 48),)
