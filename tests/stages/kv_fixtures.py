"""Real KV memory for the stage tests: torch CPU tensors behind a :class:`KVCache`.

Each (shard, engine group) gets one tensor per layer shaped like vLLM's CPU cache,
``[num_blocks, kv_heads, block_size, 2 * head_size]``, filled with random values,
so buffers point at real bytes and a store round trip can be checked byte for byte.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from kvpipe.stages import (
    BlockLayout,
    GroupKind,
    GroupSpec,
    KeyNamespace,
    KVCache,
    Region,
    SaveRequest,
    Shard,
)

with warnings.catch_warnings():  # this CPU torch build warns at import that numpy is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

MODEL = "tiny-llama"
KV_HEADS = 2
HEAD_SIZE = 4

FULL = GroupSpec(GroupKind.FULL_ATTENTION, block_size=16)
RING = GroupSpec(GroupKind.RING_BUFFER, block_size=16, prefix_cacheable=False)
MAMBA_ALIGN = GroupSpec(GroupKind.MAMBA, block_size=16, mamba_mode="align")
#: a sliding window of 24 tokens: a position reads the 23 before it, so at most two 16-token blocks
WINDOW = GroupSpec(GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=24)


@dataclass
class KVFixture:
    """A KVCache and the tensors its layouts point into (kept alive here)."""

    kv: KVCache
    tensors: dict[tuple[int, int], list[torch.Tensor]]  # (shard, engine group) -> one per layer

    def block_bytes(self, shard: int, engine_group: int, block_id: int) -> bytes:
        """The object a block should become: its bytes in every layer, in layer order."""
        return b"".join(bytes_of(layer[block_id]) for layer in self.tensors[(shard, engine_group)])


def make_kv(
    groups: Sequence[GroupSpec] = (FULL,),
    *,
    shards: int = 1,
    layers: int = 2,
    num_blocks: int = 16,
    hash_block_size: int = 16,
    model: str = MODEL,
    cache_prefix: str = "",
    seed: int = 0,
) -> KVFixture:
    """A cache with ``shards`` tp ranks, each with a layout for every engine group."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[tuple[int, int], list[torch.Tensor]] = {}
    shard_list = []
    for rank in range(shards):
        layouts = {}
        for engine_group, spec in enumerate(groups):
            per_layer = [
                torch.randn(num_blocks, KV_HEADS, spec.block_size, 2 * HEAD_SIZE, generator=generator).half()
                for _ in range(layers)
            ]
            tensors[(rank, engine_group)] = per_layer
            layouts[engine_group] = BlockLayout(
                tuple(Region(t.data_ptr(), t[0].numel() * t.element_size()) for t in per_layer)
            )
        shard_list.append(Shard(KeyNamespace(model=model, cache_prefix=cache_prefix, tp_rank=rank), layouts))
    kv = KVCache(groups=tuple(groups), hash_block_size=hash_block_size, shards=tuple(shard_list))
    return KVFixture(kv, tensors)


def chain_hashes(count: int, salt: str = "") -> tuple[bytes, ...]:
    """``count`` distinct 32-byte hashes, like the engine's chained block hashes."""
    return tuple(hashlib.sha256(f"{salt}:{i}".encode()).digest() for i in range(count))


def make_request(
    kv: KVCache,
    tokens: int,
    *,
    saved: int = 0,
    finished: bool = False,
    request_id: str = "req-1",
    first_block: int = 1,
) -> SaveRequest:
    """A request with ``tokens`` computed: every hash block hashed, every block allocated.

    Block ids start at ``first_block`` (0 is the engine's null block); give requests
    different hash salts through ``request_id`` and different blocks through it too.
    """
    block_ids = tuple(
        tuple(range(first_block, first_block + math.ceil(tokens / spec.block_size))) for spec in kv.groups
    )
    return SaveRequest(
        request_id=request_id,
        block_hashes=chain_hashes(tokens // kv.hash_block_size, salt=request_id),
        block_ids=block_ids,
        num_computed_tokens=tokens,
        num_saved_tokens=saved,
        finished=finished,
    )


def empty_bytes(nbytes: int) -> torch.Tensor:
    """Fresh destination memory for reading an object back."""
    return torch.empty(nbytes, dtype=torch.uint8)


def bytes_of(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().view(torch.uint8).flatten().tolist())
