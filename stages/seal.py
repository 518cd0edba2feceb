"""The registered memory seals travel through, to and from the store.

A store reads and writes registered memory only, so a seal (:mod:`.integrity`)
goes to and from the store through a :class:`SealMemory`: a few registered
*slabs*, each room for one call's seals. The put and load stages hold one slab
per call in flight; a call waits while every slab is held, so seal memory never
grows with load.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Protocol

import anyio

from kvpipe.pipeline.stage import BatchStage

from .integrity import SEAL_SIZE, Seal
from .store import describe

with warnings.catch_warnings():  # this CPU torch build warns at import that numpy is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

#: slabs of a seal memory: one per store call in flight (the put stage runs two workers)
SEAL_SLABS = 4


class RegisteringStore(Protocol):
    def register_buffer(self, addr: int, nbytes: int) -> int: ...

    def unregister_buffer(self, addr: int) -> int: ...


class SealMemoryError(RuntimeError):
    """Seal memory could not be registered with the store."""


class SealSlab:
    """Room for one call's seals: seal ``i`` lives at :meth:`address` ``(i)``, ``slot_bytes`` long."""

    __slots__ = ("base", "seals", "slot_bytes", "_view", "_memory")

    def __init__(self, memory: SealMemory, base: int, seals: int, slot_bytes: int = SEAL_SIZE) -> None:
        self._memory = memory
        self.base = base
        self.seals = seals
        self.slot_bytes = slot_bytes
        self._view = memoryview((ctypes.c_char * (seals * slot_bytes)).from_address(base)).cast("B")

    def address(self, index: int) -> int:
        if not 0 <= index < self.seals:
            raise IndexError(f"seal {index} of a slab of {self.seals}")
        return self.base + index * self.slot_bytes

    def write(self, index: int, seal: Seal) -> None:
        seal.pack_into(self._view, self.address(index) - self.base)

    def view(self, index: int) -> memoryview:
        """Slot ``index`` as writable bytes (a layer seal packs itself into it)."""
        offset = self.address(index) - self.base
        return self._view[offset : offset + self.slot_bytes]

    def read(self, index: int) -> bytes:
        return bytes(self.view(index))

    def release(self) -> None:
        """Give the slab back (on the pipeline's loop)."""
        self._memory.give_back(self)


class SealMemory:
    """``slabs`` registered slabs of ``seals_per_slab`` seals of ``slot_bytes`` each, allocated on first use.

    ``slot_bytes``: a seal's (:data:`~.integrity.SEAL_SIZE`), or a layer seal's
    (:func:`~.layer_seals.layer_seal_size`).
    """

    def __init__(
        self, store: RegisteringStore, seals_per_slab: int, slabs: int = SEAL_SLABS, slot_bytes: int = SEAL_SIZE
    ) -> None:
        if seals_per_slab <= 0 or slabs <= 0:
            raise ValueError(f"seal memory needs slabs > 0 and seals > 0, got {slabs} x {seals_per_slab}")
        self.seals_per_slab = seals_per_slab
        self.slot_bytes = slot_bytes
        self.slabs = slabs
        self._store = store
        self._memory: torch.Tensor | None = None
        self._free: list[SealSlab] = []
        self._returned: anyio.Event | None = None
        self._allocating: anyio.Lock | None = None  # made by the first acquire (needs the loop)

    @property
    def allocated(self) -> bool:
        return self._memory is not None

    def allocate(self) -> None:
        """Allocate and register the slabs (blocking: call from a worker thread)."""
        if self._memory is not None:
            return
        slab_bytes = self.seals_per_slab * self.slot_bytes
        # Not torch.zeros: a fill this size runs an OpenMP parallel region, and one run
        # from this (worker) thread gives the process a second OpenMP thread pool. With
        # more OpenMP threads than cores, libgomp stops spinning at its barriers, so every
        # parallel region of the engine's own thread then pays futex sleeps and wakes:
        # plain decode steps slowed (`kvpipe bench vllm-loads`, docs/bench/log/2026-12-04.md).
        # memset runs here, alone.
        memory = torch.empty(self.slabs * slab_bytes, dtype=torch.uint8)
        ctypes.memset(memory.data_ptr(), 0, memory.nbytes)
        code = self._store.register_buffer(memory.data_ptr(), memory.nbytes)
        if code != 0:
            raise SealMemoryError(f"registering {memory.nbytes} bytes of seal memory failed: {describe(code)}")
        self._memory = memory
        base = memory.data_ptr()
        self._free = [
            SealSlab(self, base + i * slab_bytes, self.seals_per_slab, self.slot_bytes) for i in range(self.slabs)
        ]

    async def acquire(self, stage: BatchStage) -> SealSlab:
        """A free slab (allocating the memory in ``stage``'s worker thread first); waits while all are held."""
        if self._memory is None:
            if self._allocating is None:
                self._allocating = anyio.Lock()
            async with self._allocating:  # two workers' first calls must not both register
                if self._memory is None:
                    await stage.run_blocking(self.allocate)
        while not self._free:
            if self._returned is None:
                self._returned = anyio.Event()
            await self._returned.wait()
        return self._free.pop()

    def give_back(self, slab: SealSlab) -> None:
        self._free.append(slab)
        if self._returned is not None:
            self._returned.set()
            self._returned = None

    def close(self) -> None:
        """Unregister the memory (blocking), once no slab is held."""
        if self._memory is not None and len(self._free) == self.slabs:
            self._store.unregister_buffer(self._memory.data_ptr())
            self._memory = None
            self._free = []
