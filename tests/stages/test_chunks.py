"""Which chunks are due: complete, unsaved, hashed and allocated; tails of finished requests."""

from dataclasses import replace

from kvpipe.stages import GroupKind, GroupSpec, full_chunks, storable_groups, tail_chunks
from kvpipe.stages.chunks import unread_tokens

from .kv_fixtures import FULL, make_kv, make_request

BIG = GroupSpec(GroupKind.FULL_ATTENTION, block_size=64)  # 4 hash blocks of 16 per chunk


def _setup(spec=FULL, hash_block_size=16):
    kv = make_kv([spec], hash_block_size=hash_block_size).kv
    return kv, storable_groups(kv)[0]


def test_one_chunk_per_complete_block():
    kv, group = _setup()
    request = make_request(kv, tokens=40)

    chunks = full_chunks(request, group, kv.hash_block_size)

    assert [(c.block_id, c.chunk_hash, c.tokens_end) for c in chunks] == [
        (1, request.block_hashes[0], 16),
        (2, request.block_hashes[1], 32),
    ]


def test_a_chunk_is_named_by_the_hash_of_its_last_hash_block():
    kv, group = _setup(BIG, hash_block_size=16)
    request = make_request(kv, tokens=128)

    chunks = full_chunks(request, group, kv.hash_block_size)

    assert [c.chunk_hash for c in chunks] == [request.block_hashes[3], request.block_hashes[7]]


def test_chunks_below_num_saved_tokens_are_not_offered_again():
    kv, group = _setup()
    request = make_request(kv, tokens=64, saved=32)

    assert [c.block_id for c in full_chunks(request, group, kv.hash_block_size)] == [3, 4]


def test_a_chunk_only_partly_saved_is_offered():
    kv, group = _setup()
    request = make_request(kv, tokens=64, saved=40)

    assert [c.block_id for c in full_chunks(request, group, kv.hash_block_size)] == [3, 4]


def test_chunks_without_a_hash_yet_are_not_offered():
    kv, group = _setup()
    hashed = make_request(kv, tokens=64)
    request = replace(hashed, block_hashes=hashed.block_hashes[:2])

    assert [c.block_id for c in full_chunks(request, group, kv.hash_block_size)] == [1, 2]


def test_chunks_without_a_block_id_are_not_offered():
    kv, group = _setup()
    request = replace(make_request(kv, tokens=64), block_ids=((1, 2, 3),))

    assert [c.block_id for c in full_chunks(request, group, kv.hash_block_size)] == [1, 2, 3]


def test_tail_is_the_hashed_tokens_after_the_last_chunk_stored_as_its_whole_block():
    kv, group = _setup(BIG, hash_block_size=16)
    request = make_request(kv, tokens=64 + 40, finished=True)  # one chunk, then 2 hash blocks + 8 tokens

    (tail,) = tail_chunks(request, group, kv.hash_block_size)

    assert tail.chunk_hash == request.block_hashes[5]
    assert tail.block_id == request.block_ids[0][1]
    assert tail.tokens_end == 96


def test_an_unfinished_request_has_no_tail():
    kv, group = _setup(BIG, hash_block_size=16)

    assert tail_chunks(make_request(kv, tokens=104), group, kv.hash_block_size) == ()


def test_no_tail_when_hash_block_size_equals_block_size():
    kv, group = _setup(FULL, hash_block_size=16)

    assert tail_chunks(make_request(kv, tokens=47, finished=True), group, kv.hash_block_size) == ()


def test_no_tail_when_fewer_tokens_than_one_hash_block_follow_the_last_chunk():
    kv, group = _setup(BIG, hash_block_size=16)

    assert tail_chunks(make_request(kv, tokens=64 + 15, finished=True), group, kv.hash_block_size) == ()


def test_a_tail_already_saved_is_not_offered_again():
    kv, group = _setup(BIG, hash_block_size=16)
    request = make_request(kv, tokens=104, saved=96, finished=True)

    assert tail_chunks(request, group, kv.hash_block_size) == ()


# -- a recurrent (mamba) group: states, not per-chunk KV ----------------------------------------

from .kv_fixtures import MAMBA_ALIGN  # noqa: E402


def test_a_mamba_group_saves_the_state_at_a_block_aligned_end_only():
    kv, group = _setup(MAMBA_ALIGN)

    assert [c.tokens_end for c in full_chunks(make_request(kv, tokens=48), group, 16)] == [48]
    assert full_chunks(make_request(kv, tokens=40), group, 16) == ()  # the state is inside a block


def test_a_mamba_state_is_saved_only_where_the_engine_holds_it():
    kv, group = _setup(MAMBA_ALIGN)
    request = replace(make_request(kv, tokens=48), state_tokens=50)  # the step went on past 48

    assert full_chunks(request, group, 16) == ()


def test_a_finished_mamba_request_gives_the_state_inside_a_block_as_its_tail():
    kv, group = _setup(MAMBA_ALIGN, hash_block_size=8)
    request = make_request(kv, tokens=40, finished=True)

    (tail,) = tail_chunks(request, group, 8)

    assert (tail.tokens_end, tail.block_id, tail.chunk_hash) == (
        40,
        request.block_ids[0][2],
        request.block_hashes[4],
    )
    assert tail_chunks(replace(request, state_tokens=44), group, 8) == ()


def test_attention_past_a_prefix_reads_its_window_the_start_of_its_chunk_or_all_of_it():
    window = GroupSpec(GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=24)
    local = GroupSpec(GroupKind.FULL_ATTENTION, block_size=16, attention_chunk=32)

    assert [unread_tokens(window, tokens) for tokens in (0, 23, 24, 48)] == [0, 0, 1, 25]
    assert [unread_tokens(local, tokens) for tokens in (31, 32, 48, 64)] == [0, 32, 32, 64]
    assert unread_tokens(FULL, 1000) == 0
