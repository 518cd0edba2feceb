"""The bytes a synthetic block holds: a pure function of the block's name, written at memory speed.

The engine stand-in writes every block a save offers, tens of thousands a run; a
seeded PRNG drawn per block ran at 0.2 GB/s and took most of a run's wall time, so
the run reported the generator's speed, not the pipeline's. Here a block is

    word[j] = (TABLE[j] ^ key) * multiplier        (int64, wrapping)

where ``TABLE[j]`` is splitmix64's ``j``-th output (fixed, computed once per
cache), and ``key`` and the odd ``multiplier`` come from one hash of the block's
name (prefix hash, rank, group). Two elementwise passes per block, over many
blocks per torch call; every block is a bijection of a random table (no two
blocks alike, no run of equal words), and any block can be recomputed alone,
which lets a read-back check know a block's bytes without remembering them.

torch has no unsigned 64-bit shift, so splitmix64's logical shifts are arithmetic
shifts with the sign copies masked off; products wrap as C's ``uint64_t`` does.
The bytes are the same in every process and run.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from collections.abc import Sequence

with warnings.catch_warnings():  # this CPU torch build warns at import that numpy is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch


def _int64(value: int) -> int:
    """A 64-bit constant as the int64 with the same bits (what torch's int64 ops take)."""
    return value - (1 << 64) if value >= 1 << 63 else value


#: splitmix64: its state's increment, its finaliser's (right shift, multiplier) rounds, its last shift
GOLDEN = _int64(0x9E3779B97F4A7C15)
_ROUNDS = ((30, _int64(0xBF58476D1CE4E5B9)), (27, _int64(0x94D049BB133111EB)))
_LAST_SHIFT = 31


def table(words: int) -> torch.Tensor:
    """splitmix64's first ``words`` outputs from state 0, as int64: what every block is made of."""
    state = torch.arange(1, words + 1, dtype=torch.int64).mul_(GOLDEN)
    scratch = torch.empty_like(state)
    for shift, multiplier in _ROUNDS:
        _xor_shifted(state, shift, scratch)
        state.mul_(multiplier)
    _xor_shifted(state, _LAST_SHIFT, scratch)
    return state


def block_keys(
    object_hashes: Sequence[bytes], rank: int, engine_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, its xor key and odd multiplier (int64 each): 16 bytes of blake2b over its name.

    Rank and group are part of the name because each rank and group stores its own
    object under one prefix hash, and those objects must differ.
    """
    salt = struct.pack("<II", rank, engine_group)
    digests = [hashlib.blake2b(h + salt, digest_size=16).digest() for h in object_hashes]
    keys = torch.tensor([int.from_bytes(d[:8], "little", signed=True) for d in digests], dtype=torch.int64)
    # Odd: multiplying by it (mod 2**64) is a bijection, so a block's words stay as distinct as the table's.
    odd = [int.from_bytes(d[8:], "little", signed=True) | 1 for d in digests]
    return keys, torch.tensor(odd, dtype=torch.int64)


def blocks(
    words: torch.Tensor, keys: torch.Tensor, multipliers: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out[b] = (words ^ keys[b]) * multipliers[b]``; returns ``out``, int64 of shape ``(len(keys), *words.shape)``."""
    per_block = (-1, *[1] * words.dim())
    torch.bitwise_xor(words, keys.view(per_block), out=out)
    return out.mul_(multipliers.view(per_block))


def _xor_shifted(words: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """``words ^= words >> shift`` with an unsigned (logical) shift."""
    torch.bitwise_right_shift(words, shift, out=scratch)
    scratch.bitwise_and_((1 << (64 - shift)) - 1)
    words.bitwise_xor_(scratch)
