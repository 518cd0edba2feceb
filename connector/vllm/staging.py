"""The worker's staging area: blocks to save are copied here, object-major, one buffer per object.

Why a copy at all: the step must not wait on the store, and vLLM may reuse a block
as soon as the step ends, so the worker copies what it saves and the save pipeline
reads the copy at its own pace.

Why object-major: vLLM's CPU cache is one tensor per layer, so a store object (a
block's bytes in every layer, concatenated in layer order: the value layout vLLM's
MooncakeStoreConnector reads and writes) is one buffer per layer in the engine's
memory. Over TCP every buffer costs ~30 us, whatever its size. Here a slot of a
KV-cache group holds that group's layers side by side, so the object is ONE buffer.

Loads do not come through here: they go straight into the engine's blocks, where a
staging copy would cost more memcpy than the per-buffer overhead it saves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvpipe.stages import BlockLayout, Region


def block_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s blocks (dimension 0) as rows of bytes, over the same memory."""
    row = tensor.stride(0) * tensor.element_size()
    storage = torch.tensor([], dtype=torch.uint8).set_(tensor.untyped_storage())
    start = tensor.storage_offset() * tensor.element_size()
    return storage[start : start + tensor.shape[0] * row].view(tensor.shape[0], row)


@dataclass(frozen=True)
class _GroupArea:
    """One KV-cache group's part of the arena: ``rows[slot]`` is one object."""

    layers: tuple[str, ...]  # the group's layers in the engine's order
    offsets: tuple[int, ...]  # where each layer's block starts within an object
    rows: torch.Tensor  # [slots, object bytes], uint8


class StagingArea:
    """``slots`` object slots per storable group, in one allocation, and the free-slot pool.

    A slot number is shared by every group (slot ``s`` of group ``g`` holds one
    chunk of ``g``), so one pool serves them all.
    """

    def __init__(
        self, kv_caches: Mapping[str, torch.Tensor], group_layers: Mapping[int, Sequence[str]], slots: int
    ) -> None:
        self._engine = {
            name: block_rows(kv_caches[name]) for layers in group_layers.values() for name in layers
        }
        sizes = {g: [self._engine[name].shape[1] for name in layers] for g, layers in group_layers.items()}
        self.arena = torch.empty(slots * sum(sum(s) for s in sizes.values()), dtype=torch.uint8)
        self._areas: dict[int, _GroupArea] = {}
        start = 0
        for group, layers in group_layers.items():
            size = sum(sizes[group])
            offsets = tuple(sum(sizes[group][:i]) for i in range(len(layers)))
            rows = self.arena[start : start + slots * size].view(slots, size)
            self._areas[group] = _GroupArea(tuple(layers), offsets, rows)
            start += slots * size
        self._free = list(range(slots - 1, -1, -1))

    def layouts(self) -> dict[int, BlockLayout]:
        """Per engine group, the layout that makes a slot id one buffer of one whole object."""
        return {g: BlockLayout((Region(a.rows.data_ptr(), a.rows.shape[1]),)) for g, a in self._areas.items()}

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """``count`` free slots (the caller checked :attr:`free`)."""
        return [self._free.pop() for _ in range(count)]

    def give_back(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def copy_in(self, engine_group: int, slot: int, block: int) -> None:
        """Copy engine block ``block`` of ``engine_group``, every layer, into ``slot``."""
        area = self._areas[engine_group]
        target = area.rows[slot]
        for name, offset in zip(area.layers, area.offsets, strict=True):
            source = self._engine[name][block]
            target[offset : offset + source.shape[0]].copy_(source)
