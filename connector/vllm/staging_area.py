"""The worker's staging area: host slots that hold whole objects, one buffer each.

Why a copy at all: the step must not wait on the store, and vLLM may reuse a block
as soon as the step ends, so the worker copies what it saves into a slot and the
save pipeline reads the slot at its own pace.

Why object-major: a store object is a block's bytes in every region of its group
(:mod:`.kv_layout`), which in the engine's memory is one buffer per layer (or per
head). Over TCP every buffer costs ~30 us whatever its size. A slot holds one
object's regions side by side, so the object is ONE buffer. A rank that holds
several store shards of a block (:mod:`.store_format`) has one object per shard:
its slot holds them one after another.

Why host memory: a GPU cache cannot be registered with a store built without
CUDA, so on a device the slots are pinned host memory: saves copy device ->
slot (non-blocking, settled once per step by :meth:`StagingArea.settle`) and
loads land in slots and are copied slot -> device blocks before the forward.
On CPU, loads skip the slots and land straight in the engine's blocks, where a
staging copy would cost more memcpy than the per-buffer overhead it saves.
The same torch calls serve both: nothing here knows which device it runs on.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvpipe.stages import BlockLayout, Region

from .kv_layout import EngineRegion, GroupLayout


@dataclass(frozen=True)
class _GroupArea:
    """One KV-cache group's part of the arena: ``rows[slot]`` is a block's objects, shard after shard."""

    shards: tuple[GroupLayout, ...]
    regions: tuple[EngineRegion, ...]  # every shard's, in slot order
    offsets: tuple[int, ...]  # where each region's block starts within a slot
    rows: torch.Tensor  # [slots, bytes of every shard's object], uint8, host


class StagingArea:
    """``slots`` object slots per storable group, in one host allocation, and the free-slot pool.

    A slot number is shared by every group (slot ``s`` of group ``g`` holds one
    chunk of ``g``), so one pool serves them all.
    """

    def __init__(self, layouts: Mapping[int, Sequence[GroupLayout]], slots: int) -> None:
        """``layouts``: per engine group, the layout of each store shard the rank holds (one, unless sharded)."""
        devices = {
            region.rows.device
            for shards in layouts.values()
            for layout in shards
            for region in layout.regions
        }
        self.device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        if devices:
            raise ValueError(f"a KV cache on several devices cannot be staged: {sorted(map(str, devices))}")
        pinned = self.device.type != "cpu"
        total = slots * sum(layout.object_size for shards in layouts.values() for layout in shards)
        self.arena = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
        self._areas: dict[int, _GroupArea] = {}
        start = 0
        for group, shards in layouts.items():
            regions = tuple(region for layout in shards for region in layout.regions)
            sizes = [r.region.bytes_per_block for r in regions]
            offsets = tuple(itertools.accumulate(sizes, initial=0))[:-1]
            size = sum(sizes)
            rows = self.arena[start : start + slots * size].view(slots, size)
            self._areas[group] = _GroupArea(tuple(shards), regions, offsets, rows)
            start += slots * size
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))

    def layouts(self) -> list[dict[int, BlockLayout]]:
        """Per store shard, per engine group: the layout that makes a slot id one buffer of one whole object."""
        shards = len(next(iter(self._areas.values())).shards) if self._areas else 1
        layouts: list[dict[int, BlockLayout]] = [{} for _ in range(shards)]
        for group, area in self._areas.items():
            slot_bytes = area.rows.shape[1]
            offset = 0
            for shard, layout in zip(layouts, area.shards, strict=True):
                size = layout.object_size
                region = Region(area.rows.data_ptr() + offset, size, 0 if size == slot_bytes else slot_bytes)
                shard[group] = BlockLayout((region,))
                offset += size
        return layouts

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """``count`` free slots (the caller checked :attr:`free`)."""
        return [self._free.pop() for _ in range(count)]

    def give_back(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def copy_in(self, engine_group: int, slot: int, block: int) -> None:
        """Start copying engine block ``block`` of ``engine_group``, every region, into ``slot``."""
        area = self._areas[engine_group]
        target = area.rows[slot]
        for region, offset in zip(area.regions, area.offsets, strict=True):
            source = region.rows[block]
            target[offset : offset + source.shape[0]].copy_(source, non_blocking=True)

    def copy_out(self, engine_group: int, slot: int, block: int) -> None:
        """Start copying ``slot`` back into engine block ``block`` of ``engine_group`` (a load)."""
        area = self._areas[engine_group]
        source = area.rows[slot]
        for region, offset in zip(area.regions, area.offsets, strict=True):
            target = region.rows[block]
            target.copy_(source[offset : offset + target.shape[0]], non_blocking=True)

    def settle(self) -> None:
        """Wait until the copies started so far are done (on CPU they already are).

        A device copy into pinned memory returns before its bytes arrive; the
        slot may only be handed to the store after this. A copy into device
        blocks runs on the current stream, ahead of the next forward on it.
        """
        if self.device.type != "cpu":
            event = torch.Event(device=self.device)
            event.record()
            event.synchronize()
