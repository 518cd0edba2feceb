"""A synthetic block's words: splitmix64's outputs, keyed per block, the same in every process."""

import hashlib

import torch

from kvpipe.connector.run import pattern

MASK = (1 << 64) - 1


def _splitmix64(count: int) -> list[int]:
    """The reference: splitmix64 from state 0, in unsigned Python integers."""
    state, out = 0, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def _unsigned(tensor: torch.Tensor) -> list[int]:
    return [word & MASK for word in tensor.tolist()]


def test_the_table_is_splitmix64_from_state_zero():
    table = _unsigned(pattern.table(1000))
    assert table[0] == 0xE220A8397B1DCDAF  # splitmix64's well-known first output
    assert table == _splitmix64(1000)


def test_a_block_is_the_table_xored_with_its_key_times_its_odd_multiplier():
    words = pattern.table(64)
    keys, multipliers = pattern.block_keys([b"a", b"b"], rank=1, engine_group=2)
    out = pattern.blocks(words, keys, multipliers, torch.empty((2, 64), dtype=torch.int64))
    for row, key, multiplier in zip(out, _unsigned(keys), _unsigned(multipliers), strict=True):
        assert multiplier % 2 == 1
        assert _unsigned(row) == [((word ^ key) * multiplier) & MASK for word in _splitmix64(64)]


def test_a_blocks_key_is_blake2b_of_its_hash_rank_and_group():
    digest = hashlib.blake2b(
        b"h" + (3).to_bytes(4, "little") + (1).to_bytes(4, "little"), digest_size=16
    ).digest()
    keys, multipliers = pattern.block_keys([b"h"], rank=3, engine_group=1)
    assert _unsigned(keys) == [int.from_bytes(digest[:8], "little")]
    assert _unsigned(multipliers) == [int.from_bytes(digest[8:], "little") | 1]
