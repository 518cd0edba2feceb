"""The worker's staging area: host slots that hold whole objects, one buffer each, filled a step at a time.

Why a copy at all: the step must not wait on the store, and vLLM may reuse a block
as soon as the step ends, so the worker copies what it saves into a slot and the
save pipeline reads the slot at its own pace.

Why object-major: a store object is a block's bytes in every region of its group
(:mod:`.kv_layout`), which in the engine's memory is one buffer per layer (or per
head). Over TCP every buffer costs ~30 us whatever its size. A slot holds one
object's regions side by side, so the object is ONE buffer. A rank that holds
several store shards of a block (:mod:`.store_format`) has one object per shard:
its slot holds them one after another.

Why batched: a step saves many blocks of many regions, and a copy per region per
block is a launch each (layers x blocks, times heads for LHBNC) from the engine
thread. Regions are rows of strided tensors, so one indexed copy per region
moves every block of the step (``index_select`` for saves, ``index_copy_`` for
loads), and regions that line up in memory (same row geometry, a constant step
apart: a layer's heads, layers carved from one allocation) are one
``[regions, blocks, bytes]`` view and one copy together. The launches per step
are a few per group, whatever the number of blocks.

Why host memory: a GPU cache cannot be registered with a store built without
CUDA, so on a device the slots are pinned host memory. A save gathers the
step's blocks into one device scratch buffer and moves it to the slots with one
transfer per run of consecutive slots (:meth:`StagingArea.take` hands out the
lowest free slots, so a step's are mostly one run); a load does the reverse.
All of it runs on a side stream (:mod:`.device`) and the engine thread never
waits: a save returns the :class:`~.device.Fence` the save pipeline waits on
before it reads the slots, and the engine's next forward waits (on the device)
for the gathers, so it cannot overwrite a block before it was read; a load's
copies are ordered before the next forward the same way. A slot given back
while a copy that touches it may still run is reused only once its fence is done.
On CPU the gathers write straight into the slots, on a copy thread of the area's
own (:class:`~.device.HostThreadDevice`, the CPU's side stream): the engine
thread waits for them only at its next step's start, if they are not done by
then; loads are copied home from the slots on the engine's thread. A load could land straight in a CPU cache's blocks, one
copy less (~11 ms per 154 MB here), but then it could not be given up past its
deadline: the store call that still writes them cannot be cancelled (:mod:`.loads`).

A save's chunks and a load's take slots the same way: :func:`into_slots` takes
free slots for where they lie in the engine (:class:`Placement`) and returns the
copies between blocks and slots (:class:`SlotCopy`) and the request's block ids
over the slots.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvpipe.stages import BlockLayout, Region
from kvpipe.stages.model import Wave

from .device import DONE, Device, Fence, device_of
from .kv_layout import GroupLayout


class Placement(NamedTuple):
    """Where one chunk of a save or a load lies in the engine: the block its last token falls in."""

    group: int  # engine KV-cache group
    table_index: int  # the chunk's index in the group's block table
    block: int  # engine block id (a tail's block is partly filled)


class SlotCopy(NamedTuple):
    """One block to move between the engine and a staging slot (either way)."""

    group: int  # engine KV-cache group
    slot: int
    block: int  # engine block id


@dataclass(frozen=True)
class _Run:
    """Regions side by side in a slot that line up in memory: ``rows[r, b]`` is block ``b`` in the run's ``r``-th."""

    offset: int  # where the run's first region starts within a slot
    rows: torch.Tensor  # uint8 [regions, num_blocks, bytes], over the engine's memory

    @property
    def span(self) -> slice:
        """The run's bytes within a slot."""
        regions, _, width = self.rows.shape
        return slice(self.offset, self.offset + regions * width)

    def columns(self, slots: torch.Tensor) -> torch.Tensor:
        """The run's part of ``slots`` ([n, slot bytes]) as ``[regions, n, bytes]``, a view."""
        regions, _, width = self.rows.shape
        part = slots[:, self.offset : self.offset + regions * width]
        # torch.unflatten, not Tensor.unflatten: the same op, but the method is unannotated in torch
        return torch.unflatten(part, 1, (regions, width)).transpose(0, 1)


@dataclass(frozen=True)
class _GroupArea:
    """One KV-cache group's part of the arena: ``rows[slot]`` is a block's objects, shard after shard."""

    shards: tuple[GroupLayout, ...]
    runs: tuple[_Run, ...]  # every shard's regions, in slot order
    rows: torch.Tensor  # [slots, bytes of every shard's object], uint8, host


class StagingArea:
    """``slots`` object slots per storable group, in one host allocation, and the free-slot pool.

    A slot number is shared by every group (slot ``s`` of group ``g`` holds one
    chunk of ``g``), so one pool serves them all. ``device`` (default: the one for
    the cache's device) is where the copies run. Raises ValueError for a cache
    on several devices.
    """

    def __init__(
        self, layouts: Mapping[int, Sequence[GroupLayout]], slots: int, device: Device | None = None
    ) -> None:
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
        self._device = device if device is not None else device_of(self.device)
        pinned = self.device.type != "cpu"
        total = slots * sum(layout.object_size for shards in layouts.values() for layout in shards)
        self.arena = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
        self._areas: dict[int, _GroupArea] = {}
        start = 0
        for group, shards in layouts.items():
            regions = [region for layout in shards for region in layout.regions]
            sizes = [r.region.bytes_per_block for r in regions]
            offsets = list(itertools.accumulate(sizes, initial=0))[:-1]
            size = sum(sizes)
            rows = self.arena[start : start + slots * size].view(slots, size)
            runs = _lined_up(list(zip(offsets, (r.rows for r in regions), strict=True)))
            self._areas[group] = _GroupArea(tuple(shards), runs, rows)
            start += slots * size
        self.slots = slots
        self._free = list(range(slots))  # a heap: the lowest slots go first, so a step's are consecutive
        self._fences: dict[int, Fence] = {}  # slot -> the last copy that touches it
        self._cooling: list[tuple[Fence, list[int]]] = []  # given back while that copy may still run
        self._waves: dict[tuple[int, Wave], tuple[_Run, ...]] = {}  # (area, wave) -> its regions, see copy_out

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
        self._reclaim()
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """The ``count`` lowest free slots, ascending (the caller checked :attr:`free`)."""
        self._reclaim()
        return [heapq.heappop(self._free) for _ in range(count)]

    def give_back(self, slots: Sequence[int]) -> None:
        """Return ``slots`` to the pool: at once, or once the last copy that touches each is done."""
        waiting: dict[int, tuple[Fence, list[int]]] = {}
        for slot in slots:
            fence = self._fences.pop(slot, DONE)
            if fence.done():
                heapq.heappush(self._free, slot)
            else:
                waiting.setdefault(id(fence), (fence, []))[1].append(slot)
        self._cooling.extend(waiting.values())

    def _reclaim(self) -> None:
        """Slots given back whose copies have finished go back to the pool (asks each fence, never waits)."""
        still: list[tuple[Fence, list[int]]] = []
        for fence, slots in self._cooling:
            if fence.done():
                for slot in slots:
                    heapq.heappush(self._free, slot)
            else:
                still.append((fence, slots))
        self._cooling = still

    def copy_in(self, copies: Sequence[SlotCopy], wave: Wave | None = None) -> Fence:
        """Start copying a step's engine blocks into their slots; the fence a reader of the slots waits on.

        ``wave``: only these byte ranges of each object (a layer-wise save's layer,
        :func:`~.kv_layout.layer_waves`). Never blocks. The engine's next step waits
        for the blocks to have been read (on a device, the device does; on a copy
        thread, :meth:`before_engine`), not for them to reach the slots.
        """
        device = self._device
        device.after_engine()
        moves: list[tuple[_GroupArea, list[tuple[int, int, int]], torch.Tensor, slice]] = []
        for area, runs, index in self._batches(copies):
            regions = area.runs if wave is None else self._wave_runs(area, wave)
            if device.host:
                for slot, first, last in runs:
                    landing = area.rows[slot : slot + last - first]
                    for run in regions:
                        device.gather(run.columns(landing), run.rows, index[first:last])
                continue
            scratch = device.scratch(len(index), area.rows.shape[1])
            for run in regions:
                device.gather(run.columns(scratch), run.rows, index)
            # a wave's columns only: the rest of the scratch holds nothing, the slots the waves before
            columns = [slice(None)] if wave is None else [run.span for run in regions]
            moves.extend((area, runs, scratch, span) for span in columns)
        if copies:
            device.record(engine_waits=True)  # the blocks are read: the engine may overwrite them
        for area, runs, scratch, span in moves:
            for slot, first, last in runs:
                device.transfer(area.rows[slot : slot + last - first, span], scratch[first:last, span])
        return self._fenced(copies)

    def _batches(
        self, copies: Sequence[SlotCopy]
    ) -> Iterator[tuple[_GroupArea, list[tuple[int, int, int]], torch.Tensor]]:
        """Per group of ``copies``: its area, its runs of neighbouring slots and its blocks' index on the device."""
        for group, pairs in _by_group(copies).items():
            runs, blocks = _batch(pairs)
            yield self._areas[group], runs, self._device.index(blocks)

    def copy_out(self, copies: Sequence[SlotCopy], wave: Wave | None = None) -> None:
        """Start copying slots into engine blocks (a load), ordered before the engine's next forward.

        ``wave``: only these byte ranges of each object (a layer-wise load's layer,
        :func:`~.kv_layout.layer_waves`), ordered before the engine's next kernel
        (its layer's attention). Never blocks; the slots are reused only once the
        copies are done.
        """
        device = self._device
        device.after_engine()
        for area, runs, index in self._batches(copies):
            regions = area.runs if wave is None else self._wave_runs(area, wave)
            if device.host:
                for slot, first, last in runs:
                    landed = area.rows[slot : slot + last - first]
                    for run in regions:
                        device.scatter(run.rows, index[first:last], run.columns(landed))
                continue
            scratch = device.scratch(len(index), area.rows.shape[1])
            for slot, first, last in runs:
                device.transfer(scratch[first:last], area.rows[slot : slot + last - first])
            for run in regions:
                device.scatter(run.rows, index, run.columns(scratch))
        self._fenced(copies, engine_waits=True)

    def _wave_runs(self, area: _GroupArea, wave: Wave) -> tuple[_Run, ...]:
        """The regions of ``area`` whose bytes lie in ``wave``'s ranges of each shard's object, one run each."""
        key = (id(area), wave)
        found = self._waves.get(key)
        if found is None:
            starts = list(itertools.accumulate((layout.object_size for layout in area.shards), initial=0))[:-1]
            ranges = [(start + offset, start + offset + size) for start in starts for offset, size in wave]
            found = tuple(
                _Run(run.offset + index * run.rows.shape[2], run.rows[index : index + 1])
                for run in area.runs
                for index in range(run.rows.shape[0])
                if any(low <= run.offset + index * run.rows.shape[2] < high for low, high in ranges)
            )
            self._waves[key] = found
        return found

    def before_engine(self) -> float:
        """On the engine thread, before its step's work: wait until no copy still reads a block it may overwrite.

        Returns the seconds it waited (0.0: none).
        """
        return self._device.before_engine()

    def close(self) -> None:
        """Finish the copies under way and stop what runs them (the slots stay readable); idempotent."""
        self._device.close()

    def _fenced(self, copies: Sequence[SlotCopy], engine_waits: bool = False) -> Fence:
        """A fence after the copies launched so far, remembered as the last to touch each slot of ``copies``."""
        fence = self._device.record(engine_waits=engine_waits)
        for _, slot, _ in copies:
            self._fences[slot] = fence
        return fence


def into_slots(
    staging: StagingArea, plan: Sequence[Placement], block_ids: tuple[tuple[int, ...], ...]
) -> tuple[list[SlotCopy], tuple[tuple[int, ...], ...]]:
    """Free slots for ``plan``'s chunks: their copies to or from the engine, and ``block_ids`` naming them.

    Loads and saves alike (a save's copies go into the slots, a load's come out);
    the caller checked :attr:`StagingArea.free`.
    """
    slots = staging.take(len(plan))
    copies = [SlotCopy(chunk.group, slot, chunk.block) for chunk, slot in zip(plan, slots, strict=True)]
    return copies, _remapped(block_ids, plan, slots)


def _remapped(
    block_ids: tuple[tuple[int, ...], ...], plan: Sequence[Placement], slots: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """``block_ids`` with each chunk of ``plan`` at its slot instead of its engine block.

    The stages read chunk ``i`` of a group from ``block_ids[g][i]``; a request
    over staging slots keeps the engine's shape with slot numbers where the
    chunks it carries are (other entries are never read).
    """
    ids = [list(group_ids) for group_ids in block_ids]
    for chunk, slot in zip(plan, slots, strict=True):
        table, index = ids[chunk.group], chunk.table_index
        if len(table) <= index:
            table.extend([slot] * (index + 1 - len(table)))
        table[index] = slot
    return tuple(tuple(group_ids) for group_ids in ids)


def _by_group(copies: Sequence[SlotCopy]) -> dict[int, list[tuple[int, int]]]:
    """``copies`` as (slot, engine block) per engine group."""
    groups: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for group, slot, block in copies:
        groups[group].append((slot, block))
    return groups


def _batch(pairs: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(slot, engine block) pairs as runs of consecutive slots and the blocks in slot order.

    A run is (its first slot, and the ``[first, last)`` range of the blocks it holds).
    """
    ordered = sorted(pairs)
    runs: list[tuple[int, int, int]] = []
    for position, (slot, _) in enumerate(ordered):
        if runs and slot == runs[-1][0] + position - runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1], position + 1)
        else:
            runs.append((slot, position, position + 1))
    return runs, [block for _, block in ordered]


def _lined_up(regions: Sequence[tuple[int, torch.Tensor]]) -> tuple[_Run, ...]:
    """(offset in a slot, rows) of a group's regions, in slot order, merged into runs where they line up."""
    runs: list[list[tuple[int, torch.Tensor]]] = []
    for offset, rows in regions:
        if runs and _continues(runs[-1], offset, rows):
            runs[-1].append((offset, rows))
        else:
            runs.append([(offset, rows)])
    return tuple(_Run(run[0][0], _stacked([rows for _, rows in run])) for run in runs)


def _continues(run: Sequence[tuple[int, torch.Tensor]], offset: int, rows: torch.Tensor) -> bool:
    """Whether ``rows`` at ``offset`` extends ``run``: next in the slot, same geometry, the run's step on."""
    last_offset, last = run[-1]
    step = rows.data_ptr() - last.data_ptr()
    return (
        offset == last_offset + last.shape[1]
        and rows.shape == last.shape
        and rows.stride() == last.stride()
        and rows.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
        and step >= rows.shape[1]  # side by side in memory too: a scatter never writes a byte twice
        and (len(run) == 1 or step == last.data_ptr() - run[-2][1].data_ptr())
    )


def _stacked(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Equal-geometry row tensors a constant step apart as one ``[len(rows), blocks, bytes]`` view."""
    first = rows[0]
    if len(rows) == 1:
        return first.unsqueeze(0)
    step = rows[1].data_ptr() - first.data_ptr()
    return first.as_strided((len(rows), *first.shape), (step, *first.stride()), first.storage_offset())
