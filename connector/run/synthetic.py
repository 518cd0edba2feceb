"""A synthetic model's KV cache: real torch CPU tensors behind a :class:`KVCache`.

Per TP rank and per KV-cache group, one tensor per layer, laid out as vLLM's CPU
attention cache is (``[num_blocks, kv_heads_per_rank, block_size, 2 * head_size]``,
K and V together); a mamba group holds one state per block instead of one entry
per token. Each rank has its own tensors and its own key namespace.

The bytes of a block are a pure function of what the block holds: the hash that
names its prefix, the rank and the group (:mod:`.pattern`). Two requests with the
same prefix write the same bytes, as a real model would, so a store read can be
checked against what the block must contain without remembering anything.
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from kvpipe.stages import BlockLayout, GroupKind, GroupSpec, KeyNamespace, KVCache, Region, Shard

with warnings.catch_warnings():  # this CPU torch build warns at import that numpy is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

from . import pattern

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: the widest integer that divides a block's bytes: blocks are copied in it (a byte-wise copy is 25x slower)
_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
#: words per torch call when filling blocks. Below torch's intra-op grain size (32k elements) one
#: thread runs a call: split over threads, the calls waited on each other on a CPU shared with the
#: pipeline's thread and ran 10x slower (measured); 256 KiB of words also stay in L2.
BATCH_WORDS = 1 << 15


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
        # Each layer's blocks as rows of its widest unit: where a batch of blocks is written with one copy.
        self._rows: dict[tuple[int, int], list[torch.Tensor]] = {}
        shards = []
        for rank in range(tp_size):
            layouts = {}
            for index, group in enumerate(groups):
                shape = _block_shape(group.spec, heads, head_size)
                layers = [torch.zeros((num_blocks, *shape), dtype=DTYPES[dtype]) for _ in range(group.layers)]
                self.tensors[(rank, index)] = layers
                unit = _UNITS[math.gcd(layers[0][0].nbytes, 8)]
                self._rows[(rank, index)] = [t.view(num_blocks, -1).view(unit) for t in layers]
                layouts[index] = BlockLayout(tuple(Region(t.data_ptr(), t[0].nbytes) for t in layers))
            shards.append(Shard(KeyNamespace(model, cache_prefix, tp_rank=rank), layouts))
        self.kv = KVCache(tuple(g.spec for g in groups), hash_block_size, tuple(shards))
        self._spans = sorted(
            _TensorSpan(t.data_ptr(), t.data_ptr() + t.nbytes, rank, index)
            for (rank, index), layers in self.tensors.items()
            for t in layers
        )
        self._starts = [span.start for span in self._spans]
        # Per group, the table words of each layer's block: a whole number of words
        # per layer, the last one cut short where the block's bytes are not.
        self._tables = {
            index: pattern.table(len(layers) * _words(layers[0][0].nbytes)).view(len(layers), -1)
            for (rank, index), layers in self.tensors.items()
            if rank == 0
        }

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layers in self.tensors.values() for t in layers)

    def memory_regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every tensor: what a store registers for zero-copy transfers."""
        return [(t.data_ptr(), t.nbytes) for layers in self.tensors.values() for t in layers]

    def object_bytes(self, rank: int, engine_group: int, object_hash: bytes) -> torch.Tensor:
        """What the object named ``object_hash`` holds (uint8): the block in every layer, concatenated."""
        table = self._tables[engine_group]
        keys, multipliers = pattern.block_keys([object_hash], rank, engine_group)
        words = pattern.blocks(table, keys, multipliers, torch.empty((1, *table.shape), dtype=torch.int64))
        block_bytes = self.tensors[(rank, engine_group)][0][0].nbytes
        return words[0].view(torch.uint8)[:, :block_bytes].reshape(-1)

    def fill_blocks(
        self, rank: int, engine_group: int, block_ids: Sequence[int], object_hashes: Sequence[bytes]
    ) -> None:
        """Write into each block the bytes of the object its hash names, many blocks per torch call.

        :raises ValueError: a block id comes twice (which of its two objects it would
            hold is not defined), or there are not as many hashes as block ids.
        """
        if len(set(block_ids)) != len(block_ids) or len(block_ids) != len(object_hashes):
            raise ValueError(
                f"fill_blocks needs distinct block ids, one hash each: {len(block_ids)} ids "
                f"({len(set(block_ids))} distinct), {len(object_hashes)} hashes"
            )
        table = self._tables[engine_group]
        keys, multipliers = pattern.block_keys(object_hashes, rank, engine_group)
        ids = torch.tensor(block_ids, dtype=torch.int64)
        step = max(1, BATCH_WORDS // table.shape[1])
        out = torch.empty((min(step, len(block_ids)), table.shape[1]), dtype=torch.int64)
        layers = list(zip(table.unbind(), self._rows[(rank, engine_group)], strict=True))
        for start in range(0, len(block_ids), step):
            batch = slice(start, start + step)
            batch_ids, batch_keys, batch_multipliers = ids[batch], keys[batch], multipliers[batch]
            batch_out = out[: len(block_ids[batch])]
            for words, rows in layers:
                blocks = pattern.blocks(words, batch_keys, batch_multipliers, batch_out)
                rows.index_copy_(0, batch_ids, blocks.view(rows.dtype)[:, : rows.shape[1]])

    def locate(self, address: int) -> tuple[int, int]:
        """The (rank, engine group) whose tensors hold ``address``."""
        index = bisect.bisect_right(self._starts, address) - 1
        span = self._spans[index] if index >= 0 else None
        if span is None or not span.start <= address < span.end:
            raise ValueError(f"address {address:#x} is not in the synthetic cache")
        return span.rank, span.engine_group


def _words(nbytes: int) -> int:
    return -(-nbytes // 8)


def _block_shape(spec: GroupSpec, heads: int, head_size: int) -> tuple[int, ...]:
    if spec.kind is GroupKind.MAMBA:
        return (heads, 2 * head_size)  # one recurrent state per block
    return (heads, spec.block_size, 2 * head_size)
