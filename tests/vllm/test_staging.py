"""The worker's staging area: a slot is one whole object, its layers' blocks side by side in layer order."""

from __future__ import annotations

import torch

from kvpipe.connector.vllm.staging import StagingArea, block_rows


def engine_layers(num_blocks: int = 6) -> dict[str, torch.Tensor]:
    """Two layers sharing one storage, as vLLM's CPU cache has them: [blocks, heads, tokens, 2*head]."""
    storage = torch.randn(2, num_blocks, 2, 4, 8).to(torch.bfloat16)
    return {"layer.0": storage[0], "layer.1": storage[1]}


def test_block_rows_are_each_block_as_bytes_over_the_same_memory() -> None:
    layer = engine_layers()["layer.1"]
    rows = block_rows(layer)
    assert rows.shape == (6, 2 * 4 * 8 * 2)
    assert rows.data_ptr() == layer.data_ptr()
    assert torch.equal(rows[3], layer[3].contiguous().view(torch.uint8).flatten())


def test_a_slot_holds_the_block_of_every_layer_concatenated_in_layer_order() -> None:
    layers = engine_layers()
    area = StagingArea(layers, {0: ["layer.0", "layer.1"]}, slots=4)
    area.copy_in(0, slot=2, block=5)
    layout = area.layouts()[0]
    (buffer,) = layout.buffers(2)  # one buffer: the whole object
    staged = area.arena[buffer.address - area.arena.data_ptr() :][: buffer.size]
    expected = torch.cat([block_rows(layers["layer.0"])[5], block_rows(layers["layer.1"])[5]])
    assert torch.equal(staged, expected)


def test_groups_share_slot_numbers_and_the_free_pool() -> None:
    layers = engine_layers()
    area = StagingArea(layers, {0: ["layer.0"], 1: ["layer.1"]}, slots=3)
    assert area.free == 3
    taken = area.take(2)
    assert area.free == 1
    area.copy_in(0, taken[0], block=1)
    area.copy_in(1, taken[0], block=4)
    zero, one = area.layouts()[0], area.layouts()[1]
    assert zero.object_size == one.object_size == block_rows(layers["layer.0"]).shape[1]
    assert zero.buffers(taken[0])[0].address != one.buffers(taken[0])[0].address
    area.give_back(taken)
    assert area.free == 3
