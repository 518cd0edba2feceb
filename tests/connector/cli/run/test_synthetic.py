"""The synthetic KV cache: real tensors whose block bytes follow from the prefix hash."""

import ctypes

import pytest

from kvpipe.connector.cli.run.engine import BlockPool
from kvpipe.connector.cli.run.synthetic import SyntheticCache, SyntheticGroup
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


def test_a_filled_block_holds_the_object_bytes_in_layer_order():
    cache = _cache()
    cache.fill_block(1, 0, 5, b"prefix")
    expected = cache.object_bytes(1, 0, b"prefix")
    assert _object_in_memory(cache, 1, 0, 5) == ctypes.string_at(expected.data_ptr(), expected.nbytes)


def test_equal_prefixes_give_equal_bytes_and_ranks_differ():
    cache = _cache()
    same = cache.object_bytes(0, 0, b"h"), cache.object_bytes(0, 0, b"h")
    assert bytes(same[0].tolist()) == bytes(same[1].tolist())
    assert bytes(cache.object_bytes(1, 0, b"h").tolist()) != bytes(same[0].tolist())


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
