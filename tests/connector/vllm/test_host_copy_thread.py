"""On a CPU cache a save's block copies run on a copy thread: the engine thread waits only at its next step.

The copy thread is the CPU's side stream (``HostThreadDevice``): ``copy_in``
returns once the copies are queued, whoever reads the slots waits on the fence,
and the engine thread waits (``before_engine``) only before its next step may
overwrite a block a copy still reads. A test holds the thread with a gate queued
ahead of the copies, so what the engine thread does meanwhile is seen for certain.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvpipe.connector.vllm.device import HostThreadDevice, device_of
from kvpipe.connector.vllm.kv_layout import group_layout
from kvpipe.connector.vllm.staging_area import StagingArea

from ...stages.openmp import openmp_workers
from .test_staging import NUM_BLOCKS, block_bytes, engine_layers, staged

WITHIN_S = 10.0  # a deadline for what must happen, never a measure of how fast
UNTOUCHED = 0xEE  # a slot's bytes before a copy reaches it


class Gate:
    """Holds the copy thread at the point it was queued until opened (or a test's deadline)."""

    def __init__(self, device: HostThreadDevice) -> None:
        self._open = threading.Event()
        self.reached = threading.Event()
        device.submit(self._hold)

    def _hold(self) -> None:
        self.reached.set()
        self._open.wait(WITHIN_S)

    def open(self) -> None:
        self._open.set()


@pytest.fixture
def device() -> Iterator[HostThreadDevice]:
    copier = HostThreadDevice()
    yield copier
    copier.close()


def area_over(layers: dict[str, torch.Tensor], device: HostThreadDevice, slots: int = 2) -> StagingArea:
    return StagingArea({0: (group_layout(layers, NUM_BLOCKS),)}, slots, device)


def test_a_cpu_cache_gets_a_copy_thread() -> None:
    assert isinstance(device_of(torch.device("cpu")), HostThreadDevice)


def test_copy_in_returns_before_the_copy_thread_has_copied_and_the_fence_says_when_it_has(
    device: HostThreadDevice,
) -> None:
    layers = engine_layers()
    area = area_over(layers, device)
    staged(area, 0, 1).fill_(UNTOUCHED)
    gate = Gate(device)
    fence = area.copy_in([(0, 1, 3)])
    assert not fence.done()
    assert bool((staged(area, 0, 1) == UNTOUCHED).all())  # the slot waits while the thread is held
    gate.open()
    fence.wait()
    assert torch.equal(staged(area, 0, 1), torch.cat([block_bytes(layers[name], 3) for name in layers]))


def test_the_engine_thread_waits_at_its_next_step_until_the_blocks_were_read(device: HostThreadDevice) -> None:
    layers = engine_layers()
    expected = torch.cat([block_bytes(layers[name], 2) for name in layers])
    area = area_over(layers, device)
    gate = Gate(device)
    area.copy_in([(0, 0, 2)])
    next_step = threading.Thread(target=area.before_engine)
    next_step.start()
    assert gate.reached.wait(WITHIN_S)
    assert next_step.is_alive()  # held: the copy has not read the block yet
    gate.open()
    next_step.join(WITHIN_S)
    assert not next_step.is_alive()
    for layer in layers.values():  # the next step overwrites the block: the slot keeps what was saved
        layer[2].fill_(7)
    assert torch.equal(staged(area, 0, 0), expected)


def test_a_slot_given_back_while_its_copy_is_held_is_handed_out_only_once_the_copy_is_done(
    device: HostThreadDevice,
) -> None:
    area = area_over(engine_layers(), device)
    gate = Gate(device)
    (slot,) = area.take(1)
    fence = area.copy_in([(0, slot, 1)])
    area.give_back([slot])
    assert area.free == 1
    gate.open()
    fence.wait()
    assert area.free == 2


def test_a_failed_copy_fails_the_reader_of_its_slots_and_never_the_engine(device: HostThreadDevice) -> None:
    area = area_over(engine_layers(), device)

    def broken() -> None:
        raise ValueError("no such block")

    device.submit(broken)
    fence = area.copy_in([(0, 0, 1)])
    with pytest.raises(RuntimeError, match="staging copy failed"):
        fence.wait()
    area.before_engine()  # returns: the engine's blocks are not read any more
    area.copy_in([(0, 1, 2)]).wait()  # and a later copy runs as ever


def test_the_copy_thread_runs_torch_with_one_thread_and_starts_no_openmp_pool(device: HostThreadDevice) -> None:
    torch.zeros(1 << 24, dtype=torch.uint8)  # this (the engine's) thread has its pool
    before = openmp_workers()
    team: list[int] = []
    device.submit(lambda: team.append(torch.get_num_threads()))
    device.submit(lambda: torch.zeros(1 << 24, dtype=torch.uint8))  # parallel anywhere torch may be
    device.record(engine_waits=False).wait()
    assert team == [1]
    assert openmp_workers() <= before


def copy_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "kvpipe-staging-copy"}


def test_close_runs_what_was_queued_and_ends_the_thread() -> None:
    layers = engine_layers()
    device = HostThreadDevice()
    area = area_over(layers, device)
    others = copy_threads()  # other areas' in this process
    fence = area.copy_in([(0, 0, 4)])
    (mine,) = copy_threads() - others
    area.close()
    assert fence.done()
    assert not mine.is_alive()
    assert torch.equal(staged(area, 0, 0), torch.cat([block_bytes(layers[name], 4) for name in layers]))
