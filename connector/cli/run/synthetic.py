"""A synthetic model's KV cache: real torch CPU tensors behind a :class:`KVCache`.

Per TP rank and per KV-cache group, one tensor per layer, laid out as vLLM's CPU
attention cache is (``[num_blocks, kv_heads_per_rank, block_size, 2 * head_size]``,
K and V together); a mamba group holds one state per block instead of one entry
per token. Each rank has its own tensors and its own key namespace.

The bytes of a block are a pure function of what the block holds: the hash that
names its prefix, the rank and the group. Two requests with the same prefix write
the same bytes, as a real model would, so a store read can be checked against
what the block must contain without remembering anything.
"""

from __future__ import annotations

import bisect
import hashlib
import warnings
from dataclasses import dataclass

from kvpipe.stages import BlockLayout, GroupKind, GroupSpec, KeyNamespace, KVCache, Region, Shard

with warnings.catch_warnings():  # this CPU torch build warns at import that numpy is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class SyntheticGroup:
    spec: GroupSpec
    layers: int


@dataclass(frozen=True, order=True)
class _TensorSpan:
    start: int
    end: int
    rank: int
    engine_group: int


class SyntheticCache:
    """The tensors of every rank and group, and the KVCache the save stages see."""

    def __init__(
        self,
        *,
        model: str,
        cache_prefix: str,
        groups: list[SyntheticGroup],
        tp_size: int,
        kv_heads: int,
        head_size: int,
        dtype: str,
        num_blocks: int,
        hash_block_size: int,
    ) -> None:
        if kv_heads % tp_size:
            raise ValueError(
                f"model.kv_heads ({kv_heads}) must be a multiple of parallel.tp_size ({tp_size})"
            )
        heads = kv_heads // tp_size
        self.groups = groups
        self.tensors: dict[tuple[int, int], list[torch.Tensor]] = {}
        shards = []
        for rank in range(tp_size):
            layouts = {}
            for index, group in enumerate(groups):
                shape = _block_shape(group.spec, heads, head_size)
                layers = [torch.zeros((num_blocks, *shape), dtype=DTYPES[dtype]) for _ in range(group.layers)]
                self.tensors[(rank, index)] = layers
                layouts[index] = BlockLayout(tuple(Region(t.data_ptr(), t[0].nbytes) for t in layers))
            shards.append(Shard(KeyNamespace(model, cache_prefix, tp_rank=rank), layouts))
        self.kv = KVCache(tuple(g.spec for g in groups), hash_block_size, tuple(shards))
        self._spans = sorted(
            _TensorSpan(t.data_ptr(), t.data_ptr() + t.nbytes, rank, index)
            for (rank, index), layers in self.tensors.items()
            for t in layers
        )
        self._starts = [span.start for span in self._spans]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layers in self.tensors.values() for t in layers)

    def memory_regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every tensor: what a store registers for zero-copy transfers."""
        return [(t.data_ptr(), t.nbytes) for layers in self.tensors.values() for t in layers]

    def object_bytes(self, rank: int, engine_group: int, object_hash: bytes) -> torch.Tensor:
        """What the object named ``object_hash`` holds (uint8): the block in every layer, concatenated."""
        seed = int.from_bytes(
            hashlib.sha256(object_hash + bytes([rank, engine_group])).digest()[:8], "little"
        )
        generator = torch.Generator().manual_seed(seed)
        total = sum(t[0].nbytes for t in self.tensors[(rank, engine_group)])
        # Drawn as int64 and viewed as bytes: five times faster than drawing bytes.
        words = torch.randint(-(2**62), 2**62, ((total + 7) // 8,), dtype=torch.int64, generator=generator)
        return words.view(torch.uint8)[:total]

    def fill_block(self, rank: int, engine_group: int, block_id: int, object_hash: bytes) -> None:
        """Write the bytes a block holding the prefix named ``object_hash`` must have."""
        data = self.object_bytes(rank, engine_group, object_hash)
        offset = 0
        for layer in self.tensors[(rank, engine_group)]:
            block = layer[block_id].view(-1).view(torch.uint8)
            block.copy_(data[offset : offset + block.numel()])
            offset += block.numel()

    def locate(self, address: int) -> tuple[int, int]:
        """The (rank, engine group) whose tensors hold ``address``."""
        index = bisect.bisect_right(self._starts, address) - 1
        span = self._spans[index] if index >= 0 else None
        if span is None or not span.start <= address < span.end:
            raise ValueError(f"address {address:#x} is not in the synthetic cache")
        return span.rank, span.engine_group


def _block_shape(spec: GroupSpec, heads: int, head_size: int) -> tuple[int, ...]:
    if spec.kind is GroupKind.MAMBA:
        return (heads, 2 * head_size)  # one recurrent state per block
    return (heads, spec.block_size, 2 * head_size)
