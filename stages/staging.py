"""Gather staging memory: a bounded pool of registered slots, and the copy into them.

A KV block of one object is scattered over one buffer per layer. A transfer
engine pays per buffer over TCP, whatever its size, so an object of 64 small
per-layer buffers costs 64 round trips of bookkeeping where one contiguous
buffer would cost one (``kvpipe bench tcp`` puts both; BENCHMARKS.md). Gathering copies an object's buffers into
one slot of this pool first; memory bandwidth is two orders of magnitude above
what a put reaches, so the extra copy is cheap where the per-buffer cost is not.

The pool is bounded (``slots``): a gather waits for a free slot, so staging
memory never grows with load, and a slow store slows the gather rather than
filling memory. It is allocated and registered with the store on first use, so
a pipeline that never gathers costs nothing.

The copy is vectorized. Buffers at the same position of objects of the same
shape (layer ``j`` of every block) are rows of one strided region in the
engine's layout, so one indexed copy per position moves them all; only objects
whose buffers do not line up that way are copied buffer by buffer.
"""

from __future__ import annotations

import ctypes
import warnings
from array import array
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import cast

import anyio

from .integrity import checksum
from .model import BlockBuffers, BlockLayout, StoreObject
from .store import SavingStore, describe
from .torch_threads import single_threaded_torch

with warnings.catch_warnings():  # this CPU torch build warns at import that numpy is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch


class StagingError(RuntimeError):
    """The pool's memory could not be registered with the store."""


class StagingSlot:
    """One slot of the pool, held by one record from gather until its put returns."""

    __slots__ = ("index", "address", "checksum", "_pool", "_released")

    def __init__(self, pool: StagingPool, index: int) -> None:
        self._pool = pool
        self.index = index
        self.address = pool.base_address + index * pool.slot_bytes
        #: the copied object's checksum, if :func:`gather_into_slots` was asked for it
        self.checksum: int | None = None
        self._released = False

    def pool_memory(self) -> torch.Tensor:
        return self._pool.memory

    def release(self) -> None:
        """Give the slot back (once; later calls do nothing). On the pipeline's loop."""
        if not self._released:
            self._released = True
            self._pool.give_back(self.index)


class StagingPool:
    """``slots`` registered slots of ``slot_bytes`` each, handed out in runs of neighbours.

    Slots go out as a ring: each run starts where the last one ended. Puts finish
    roughly in the order their objects were gathered, so the slots ahead are free
    again by the time the ring comes round, and a run of neighbours lets a round's
    copy write straight into its slots (one pass over the bytes, not two).
    """

    def __init__(self, store: SavingStore, slots: int, slot_bytes: int) -> None:
        if slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"staging needs slots > 0 and slot_bytes > 0, got {slots} x {slot_bytes}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._store = store
        self._memory: torch.Tensor | None = None
        self._held = bytearray(slots)  # 1 while a record holds the slot
        self._next = 0  # where the next run starts
        self._released: anyio.Event | None = None  # made by the first waiter (needs the loop)

    @property
    def allocated(self) -> bool:
        return self._memory is not None

    @property
    def base_address(self) -> int:
        assert self._memory is not None, "allocate() first"
        return self._memory.data_ptr()

    @property
    def memory(self) -> torch.Tensor:
        assert self._memory is not None, "allocate() first"
        return self._memory

    @property
    def free(self) -> int:
        return self._held.count(0)

    def allocate(self) -> None:
        """Allocate and register the slots (blocking: call from a worker thread)."""
        if self._memory is not None:
            return
        memory = torch.empty((self.slots, self.slot_bytes), dtype=torch.uint8)
        code = self._store.register_buffer(memory.data_ptr(), memory.nbytes)
        if code != 0:
            raise StagingError(
                f"registering {memory.nbytes} bytes of staging memory failed: {describe(code)}"
            )
        self._memory = memory

    def close(self) -> None:
        """Unregister the memory (blocking). Slots still held must not be used after this."""
        if self._memory is not None:
            self._store.unregister_buffer(self._memory.data_ptr())
            self._memory = None

    async def acquire_run(self, count: int) -> list[StagingSlot]:
        """``count`` neighbouring slots (at most all of them); waits while they are held."""
        if not 0 < count <= self.slots:
            raise ValueError(f"a run of {count} slots from a pool of {self.slots}")
        while True:
            start = self._next if self._next + count <= self.slots else 0  # a run does not wrap
            if not any(self._held[start : start + count]):
                self._held[start : start + count] = b"\x01" * count
                self._next = (start + count) % self.slots
                return [StagingSlot(self, index) for index in range(start, start + count)]
            if self._released is None:
                self._released = anyio.Event()
            await self._released.wait()

    def give_back(self, index: int) -> None:
        """One slot is free again (on the pipeline's loop); wakes whoever waits for a run."""
        self._held[index] = 0
        if self._released is not None:
            self._released.set()
            self._released = None


def copy_into_slots(
    records: Sequence[StoreObject], slots: Sequence[StagingSlot], checksums: bool = False
) -> None:
    """Copy each record's buffers, concatenated, to the start of its slot (blocking).

    Records are grouped by layout (blocks of one cache group: their addresses
    are computed for the whole group at once) or, for plain buffers, by their
    sizes. A group whose sources are rows of strided regions (every address a
    whole number of rows from the lowest at its position) is copied with
    indexed copies; any other group one buffer at a time.

    ``checksums``: set each slot's :attr:`~StagingSlot.checksum` too, taken as
    soon as its object is whole in the slot: a piece of :data:`HASHED_PIECE_BYTES`
    at a time where one indexed copy moves whole objects, so that the bytes are
    still in the CPU's cache, else once the group is copied.
    """
    if not records:
        return
    memory = slots[0].pool_memory()
    groups: dict[BlockLayout | tuple[int, ...], list[int]] = defaultdict(list)
    for position, record in enumerate(records):
        buffers = record.buffers
        key = buffers.layout if isinstance(buffers, BlockBuffers) else tuple(b.size for b in buffers)
        groups[key].append(position)
    for key, members in groups.items():
        group_slots = [slots[m] for m in members]
        copied = _hasher(records, slots, members) if checksums else None
        table: torch.Tensor | None
        if isinstance(key, BlockLayout):
            shape = tuple(region.bytes_per_block for region in key.regions)
            bases = torch.tensor([region.base for region in key.regions])
            # grouped by layout: these records' buffers are blocks of it
            block_ids = torch.tensor([cast(BlockBuffers, records[m].buffers).block_id for m in members])
            table = bases + block_ids[:, None] * torch.tensor([region.step for region in key.regions])
        else:
            shape = key
            flat = array("q", (b.address for m in members for b in records[m].buffers))
            table = torch.frombuffer(flat, dtype=torch.int64).view(len(members), len(shape)) if flat else None
        if table is None or not _gather_rows(memory, table, group_slots, shape, copied):
            for position, (member, slot) in enumerate(zip(members, group_slots, strict=True)):
                offset = 0
                for buffer in records[member].buffers:
                    ctypes.memmove(slot.address + offset, buffer.address, buffer.size)
                    offset += buffer.size
                if copied is not None:
                    copied(position, position + 1)


#: objects copied between two rounds of checksums where one indexed copy moves whole
#: objects: within a core's L2 cache, from which their bytes are read again
HASHED_PIECE_BYTES = 512 * 1024


def _hasher(
    records: Sequence[StoreObject], slots: Sequence[StagingSlot], members: list[int]
) -> Callable[[int, int], None]:
    """``copied(start, stop)``: members ``start:stop`` are in their slots; take their checksums."""

    def copied(start: int, stop: int) -> None:
        for member in members[start:stop]:
            slot = slots[member]
            slot.checksum = checksum([slot.address], [records[member].size])

    return copied


def gather_into_slots(
    records: Sequence[StoreObject], slots: Sequence[StagingSlot], checksums: bool = False
) -> None:
    """:func:`copy_into_slots` from a pipeline's worker thread, which first gets an OpenMP team of one.

    ``checksums``: each slot's checksum too, for the put's seals, which then do not
    read the bytes again (hashed in the put's thread, long after the copy, they came
    from memory again, on the thread whose calls the store's throughput waits for).

    Never on an engine's thread: its own ops would lose their parallelism.
    """
    single_threaded_torch()
    copy_into_slots(records, slots, checksums)


#: Below this many elements torch runs an op on the calling thread alone
#: (``at::internal::GRAIN_SIZE``). A thread whose OpenMP team is larger than one
#: copies in pieces under it: OpenMP helpers would take the core that the
#: store's transfer threads and the engine need, and a pool started off the
#: engine's thread slows its every forward (:mod:`.torch_threads`). The gather
#: stage's threads have a team of one (:func:`gather_into_slots`), so they copy a
#: group in one op.
GRAIN = 32768


def _gather_rows(
    memory: torch.Tensor,
    table: torch.Tensor,
    slots: list[StagingSlot],
    shape: tuple[int, ...],
    copied: Callable[[int, int], None] | None = None,
) -> bool:
    """The vectorized copy of one same-shape group (``table``: its [objects, buffers] addresses).

    False, copying nothing, if the sources are not rows of strided regions.
    ``copied(start, stop)`` is told of objects ``start:stop`` once they are whole in
    their slots: a piece at a time from one grid, all at the end otherwise.
    """
    if not shape or 0 in shape:
        return False
    word = 8 if all(size % 8 == 0 for size in shape) and not bool((table % 8).any()) else 1
    dtype = torch.int64 if word == 8 else torch.uint8
    low = int(table.amin())
    span = int(table.amax()) + max(shape) - low
    source = torch.frombuffer((ctypes.c_char * span).from_address(low), dtype=torch.uint8).view(dtype)
    destination = memory.view(dtype)
    slot_rows = torch.tensor([slot.index for slot in slots])
    offsets = table - low
    size = shape[0]
    if all(s == size for s in shape) and not bool((offsets % size).any()):
        # One grid of equal rows holds every source (e.g. the per-layer tensors of
        # one cache): each object's rows come out contiguous from one indexed copy.
        grid = source.narrow(0, 0, span // size * size // word).view(-1, size // word)
        _indexed_copy(grid, offsets // size, destination[:, : sum(shape) // word], slot_rows, copied)
        return True
    lows = offsets.amin(dim=0)
    sizes = torch.tensor(shape)
    if bool(((offsets - lows) % sizes).any()):
        return False
    rows = (offsets - lows) // sizes
    column = 0
    for position, size in enumerate(shape):
        count = int(rows[:, position].amax()) + 1
        region = source.narrow(0, int(lows[position]) // word, count * size // word).view(count, size // word)
        columns = destination[:, column : column + size // word]
        _indexed_copy(region, rows[:, position : position + 1], columns, slot_rows)
        column += size // word
    # Objects are whole only after the last region. (Copied a piece of objects at a time
    # to hash them while cached, region after region, the hashing cost as much as from
    # memory on 2 busy cores, 6.3 us per 64 KiB, and the copy took more calls.)
    if copied is not None:
        copied(0, len(slots))
    return True


def _indexed_copy(
    source: torch.Tensor,
    index: torch.Tensor,
    columns: torch.Tensor,
    slot_rows: torch.Tensor,
    copied: Callable[[int, int], None] | None = None,
) -> None:
    """``columns[slot_rows[i]] = concat(source[index[i, :]])`` for every object i, in GRAIN pieces.

    When the slots are neighbours (the usual case: a run from the pool), the rows
    are selected straight into the slots, also where the columns are a part of
    each slot's row (one region of a per-layer cache: a strided target, which the
    indexed copy writes in place; 1.2 ms against 1.55 through a temporary for 8 MiB
    of 1 KiB rows); otherwise, or where an object's several rows would have to land
    in a part of its slot, through a temporary.
    """
    objects, rows_per_object = index.shape
    width = rows_per_object * source.shape[1]
    step = objects if torch.get_num_threads() == 1 else max(1, GRAIN // width)
    if copied is not None:  # pieces the cache holds between copy and checksum
        step = min(step, max(1, HASHED_PIECE_BYTES // (width * source.element_size())))
    first = int(slot_rows[0])
    in_place = (columns.is_contiguous() or rows_per_object == 1) and bool(
        (slot_rows == torch.arange(first, first + objects)).all()
    )
    for start in range(0, objects, step):
        part = index[start : start + step]
        if in_place:
            target = columns.narrow(0, first + start, len(part))
            if rows_per_object > 1:  # contiguous: an object's rows follow one another in its slot
                target = target.view(len(part) * rows_per_object, -1)
            torch.index_select(source, 0, part.reshape(-1), out=target)
        else:
            gathered = source.index_select(0, part.reshape(-1)).view(len(part), width)
            columns.index_copy_(0, slot_rows[start : start + step], gathered)
        if copied is not None:
            copied(start, start + len(part))
