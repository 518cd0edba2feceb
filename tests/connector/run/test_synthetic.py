"""The synthetic KV cache: real tensors whose block bytes follow from the prefix hash."""

import ctypes

import pytest
import torch

from kvpipe.connector.run import synthetic
from kvpipe.connector.run.engine import BlockPool
from kvpipe.connector.run.synthetic import SyntheticCache, SyntheticGroup
from kvpipe.stages import GroupKind, GroupSpec

FULL = SyntheticGroup(GroupSpec(GroupKind.FULL_ATTENTION, 16), layers=3)
MAMBA = SyntheticGroup(GroupSpec(GroupKind.MAMBA, 16, mamba_mode="align"), layers=2)


def _cache(**overrides) -> SyntheticCache:
    params = dict(
        model="m",
        cache_prefix="",
        groups=[FULL, MAMBA],
        tp_size=2,
        kv_heads=4,
        head_size=8,
        dtype="bfloat16",
        num_blocks=8,
        hash_block_size=16,
    )
    return SyntheticCache(**(params | overrides))


def _object_in_memory(cache: SyntheticCache, rank: int, group: int, block_id: int) -> bytes:
    layout = cache.kv.shards[rank].layouts[group]
    return b"".join(ctypes.string_at(b.address, b.size) for b in layout.buffers(block_id))


def _bytes(tensor) -> bytes:
    return ctypes.string_at(tensor.data_ptr(), tensor.nbytes)


def test_a_filled_block_holds_the_object_bytes_in_layer_order():
    cache = _cache()
    cache.fill_blocks(1, 0, [5], [b"prefix"])
    assert _object_in_memory(cache, 1, 0, 5) == _bytes(cache.object_bytes(1, 0, b"prefix"))


def test_the_bytes_are_a_pure_function_of_hash_rank_and_group():
    first, second = _cache(), _cache()
    assert _bytes(first.object_bytes(0, 0, b"h")) == _bytes(second.object_bytes(0, 0, b"h"))
    others = [first.object_bytes(*name) for name in [(1, 0, b"h"), (0, 0, b"g"), (0, 1, b"h")]]
    assert len({_bytes(first.object_bytes(0, 0, b"h")), *map(_bytes, others)}) == 4


def test_a_block_filled_in_a_batch_holds_what_it_holds_filled_alone():
    alone, batched = _cache(), _cache()
    alone.fill_blocks(0, 0, [5], [b"h"])
    batched.fill_blocks(0, 0, [2, 5, 7], [b"a", b"h", b"b"])
    assert _object_in_memory(batched, 0, 0, 5) == _object_in_memory(alone, 0, 0, 5)


def test_a_batch_split_over_several_torch_calls_fills_every_block(monkeypatch):
    monkeypatch.setattr(synthetic, "BATCH_WORDS", 256)  # two blocks of 128 words a call: 7 blocks take 4
    cache = _cache()
    hashes = [bytes([i]) for i in range(1, 8)]
    cache.fill_blocks(0, 0, list(range(1, 8)), hashes)
    for block_id, object_hash in enumerate(hashes, 1):
        assert _object_in_memory(cache, 0, 0, block_id) == _bytes(cache.object_bytes(0, 0, object_hash))


def test_no_eight_byte_word_repeats_within_an_object():
    words = _cache().object_bytes(0, 0, b"h").view(torch.int64).tolist()
    assert len(set(words)) == len(words)


def test_blocks_whose_bytes_are_not_whole_words_round_trip():
    cache = _cache(groups=[MAMBA], tp_size=1, kv_heads=1, head_size=3, dtype="float16")
    assert cache.kv.shards[0].layouts[0].object_size == 2 * 12  # layers * 12 bytes: 1.5 words a layer
    cache.fill_blocks(0, 0, [3], [b"h"])
    assert _object_in_memory(cache, 0, 0, 3) == _bytes(cache.object_bytes(0, 0, b"h"))


def test_filling_one_block_twice_in_a_batch_is_refused():
    with pytest.raises(ValueError, match="distinct block ids"):
        _cache().fill_blocks(0, 0, [5, 5], [b"a", b"b"])


def test_each_rank_has_its_own_tensors_and_namespace():
    cache = _cache()
    assert [shard.namespace.tp_rank for shard in cache.kv.shards] == [0, 1]
    assert cache.kv.shards[0].layouts[0] != cache.kv.shards[1].layouts[0]


def test_a_mamba_group_holds_one_state_per_block():
    cache = _cache()
    full, mamba = cache.kv.shards[0].layouts[0], cache.kv.shards[0].layouts[1]
    assert full.object_size == 3 * 2 * 16 * 16 * 2  # layers * heads/rank * block * 2*head_size * bf16
    assert mamba.object_size == 2 * 2 * 16 * 2


def test_locate_names_the_rank_and_group_of_an_address():
    cache = _cache()
    buffer = cache.kv.shards[1].layouts[1].buffers(3)[1]
    assert cache.locate(buffer.address) == (1, 1)
    with pytest.raises(ValueError, match="not in the synthetic cache"):
        cache.locate(16)


def test_kv_heads_must_split_over_ranks():
    with pytest.raises(ValueError, match=r"kv_heads \(4\) must be a multiple of parallel.tp_size \(3\)"):
        _cache(tp_size=3)


def test_the_block_pool_never_hands_out_the_null_block_and_takes_blocks_back():
    pool = BlockPool(groups=2, num_blocks=4)
    taken = pool.allocate([3, 3])
    assert taken is not None and all(0 not in ids for ids in taken)
    assert pool.allocate([1, 0]) is None
    pool.release(taken)
    assert pool.allocate([3, 3]) is not None
