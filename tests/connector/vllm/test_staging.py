"""The worker's staging area: a slot is one whole object, its regions' blocks side by side in region order."""

from __future__ import annotations

import torch

from kvpipe.connector.vllm.kv_layout import group_layout
from kvpipe.connector.vllm.staging_area import StagingArea

NUM_BLOCKS = 6


def engine_layers() -> dict[str, torch.Tensor]:
    """Two layers sharing one storage, as vLLM's CPU cache has them: [blocks, heads, tokens, 2*head]."""
    storage = torch.randint(-1000, 1000, (2, NUM_BLOCKS, 2, 4, 8), dtype=torch.int16).view(torch.bfloat16)
    return {"layer.0": storage[0], "layer.1": storage[1]}


def block_bytes(layer: torch.Tensor, block: int) -> torch.Tensor:
    return layer[block].contiguous().view(torch.uint8).flatten()


def staged(area: StagingArea, group: int, slot: int) -> torch.Tensor:
    (buffer,) = area.layouts()[0][group].buffers(slot)  # one buffer: the whole object
    return area.arena[buffer.address - area.arena.data_ptr() :][: buffer.size]


def test_a_slot_holds_the_block_of_every_layer_concatenated_in_layer_order() -> None:
    layers = engine_layers()
    area = StagingArea({0: (group_layout(layers, NUM_BLOCKS),)}, slots=4)
    area.copy_in([(0, 2, 5)]).wait()
    expected = torch.cat([block_bytes(layers["layer.0"], 5), block_bytes(layers["layer.1"], 5)])
    assert torch.equal(staged(area, 0, 2), expected)


def test_copy_out_puts_a_slot_back_into_an_engine_block() -> None:
    source, target = engine_layers(), engine_layers()
    area = StagingArea({0: (group_layout(target, NUM_BLOCKS),)}, slots=2)
    staged(area, 0, 1).copy_(
        torch.cat([block_bytes(source["layer.0"], 4), block_bytes(source["layer.1"], 4)])
    )
    area.copy_out([(0, 1, 0)])
    for name in source:
        assert torch.equal(target[name][0].view(torch.int16), source[name][4].view(torch.int16))


def test_groups_share_slot_numbers_and_the_free_pool() -> None:
    layers = engine_layers()
    zero, one = group_layout({"layer.0": layers["layer.0"]}, NUM_BLOCKS), group_layout(layers, NUM_BLOCKS)
    area = StagingArea({0: (zero,), 1: (one,)}, slots=3)
    assert area.free == 3
    taken = area.take(2)
    assert area.free == 1
    area.copy_in([(0, taken[0], 1), (1, taken[0], 4)]).wait()
    assert torch.equal(staged(area, 0, taken[0]), block_bytes(layers["layer.0"], 1))
    assert staged(area, 1, taken[0]).numel() == 2 * staged(area, 0, taken[0]).numel()
    area.give_back(taken)
    assert area.free == 3


def test_on_cpu_the_arena_is_plain_host_memory() -> None:
    area = StagingArea({0: (group_layout(engine_layers(), NUM_BLOCKS),)}, slots=1)
    assert area.device.type == "cpu" and not area.arena.is_pinned()
