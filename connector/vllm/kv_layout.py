"""Engine KV tensors -> kvpipe :class:`~kvpipe.stages.BlockLayout`: the one place that knows a KV layout.

vLLM 0.32 describes a KV cache as a logical ``[L, B, H, N, C]`` array that a
``KVCacheLayout`` places in memory (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC) and
hands the connector one ``[B, H, N, C]`` view per layer (MLA: ``[B, N, C]``; a
mamba layer: a list of state views over one page). A store object is one
block of one KV-cache group: the block's bytes in every *region* of the group,
concatenated, which is exactly what vLLM's ``MooncakeStoreConnector`` puts
(``RankLocalStoreLayout.register_kv_caches``/``prepare_values``), so the two
connectors read each other's objects.

What a region is follows from the strides alone, never from a layout's name,
so a layout vLLM adds later is either handled or refused, never mis-stored:

- **a dense block is one region per layer**: block ``b`` of the layer is one
  gapless run of bytes at ``data_ptr + b * stride(0)``, ``stride(0)`` bytes long
  (padding at the end of a page included, as vLLM's connector reads it);
- **a block that is not dense is one region per head**, when each head's block
  is dense (LHBNC: heads outside blocks);
- **runs that share one row are one region**: when B is outermost (BLHNC,
  BLNHC, BHLNC: vLLM's cross-layer KV) every layer's (or head's) block lies in
  one ``stride(0)``-byte row of a storage that holds them all, so the row is the
  region: one buffer for the whole object;
- **anything else is refused at start**, naming the layer and the layout:
  bytes that cannot be named as equal-stride rows would be stored wrong.

A layer's bytes are the regions that hold it, so in every layout but the
cross-layer ones a layer is one byte range of the object (two where its K and V
lie apart): :func:`layer_waves` names them, for layer-wise loads.

Every region steps by its own size from block to block, which is what
:class:`~kvpipe.stages.Region` promises, and is checked to stay inside its
storage for the last block. Each region also carries a ``uint8`` view of its
rows (``[num_blocks, bytes]``) on the tensor's own device, which is what the
staging copy reads: the same code serves CPU and CUDA caches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvpipe.stages import BlockLayout, Region
from kvpipe.stages.errors import ConfigError
from kvpipe.stages.model import Wave

__all__ = [
    "EngineRegion",
    "GroupLayout",
    "LayoutError",
    "group_layout",
    "is_dense",
    "layer_facts",
    "shard_layouts",
    "storages_of",
]


class LayoutError(ConfigError):
    """The engine's KV tensors cannot be stored as blocks; the message names the layer and the layout."""


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements cover one gapless, non-overlapping range, in any dimension order."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True)
class EngineRegion:
    """One region of a group: ``rows[b]`` is block ``b``'s bytes in it, over the engine's memory."""

    region: Region
    rows: torch.Tensor  # uint8 [num_blocks, region.bytes_per_block], on the cache's device
    layers: tuple[str, ...]  # the layers whose bytes it holds (several for a shared row)


@dataclass(frozen=True)
class GroupLayout:
    """A storable group's regions, in object order: layer order, then head order."""

    regions: tuple[EngineRegion, ...]

    @property
    def block_layout(self) -> BlockLayout:
        return BlockLayout(tuple(r.region for r in self.regions))

    @property
    def object_size(self) -> int:
        return self.block_layout.object_size


@dataclass(frozen=True)
class _Run:
    """A dense run of bytes repeated per block: one layer's (or one head's) block."""

    layer: str
    start: int  # address of block 0's run
    nbytes: int  # the run's dense bytes
    stride: int  # bytes from one block's run to the next
    storage: torch.UntypedStorage


def _representative(name: str, value: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensor that stands for a layer: itself, or for a mamba layer the first state view.

    A mamba layer's states (conv, ssm) are views over one page per block; the
    page is the region, as vLLM's connector takes it (its first view), so the
    other views must lie in the same page.
    """
    if isinstance(value, torch.Tensor):
        return value
    views = list(value)
    if not views:
        raise LayoutError(f"KV cache of layer {name!r} is an empty list of tensors")
    first = views[0]
    stride = first.stride(0) * first.element_size()
    for view in views[1:]:
        offset = view.data_ptr() - first.data_ptr()
        span = _block_span(view)
        if view.stride(0) * view.element_size() != stride or offset < 0 or offset + span > stride:
            raise LayoutError(
                f"KV cache of layer {name!r}: its state views do not share one page per block "
                f"(view {tuple(view.shape)} strides {view.stride()} at offset {offset}, page {stride} bytes)"
            )
    return first


def layer_facts(
    layers: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], shards: int = 1
) -> list[list[object]]:
    """Per layer, in order: its name and each KV view's dtype and object's block shape (no block count).

    Part of the seals' fingerprint: two engines whose layers agree in these (and
    in the layout) lay a block's bytes out alike, whatever their block counts.
    With ``shards`` store shards a rank (:func:`shard_layouts`), an object holds
    ``1 / shards`` of the rank's heads, which is what engines of every TP size
    sharing the format agree on.
    """
    facts: list[list[object]] = []
    for name, value in layers.items():
        views = [value] if isinstance(value, torch.Tensor) else list(value)
        shapes = [
            [view.shape[1] // shards, *view.shape[2:]] if shards > 1 else list(view.shape[1:])
            for view in views
        ]
        facts.append([name, *[[str(view.dtype), shape] for view, shape in zip(views, shapes, strict=True)]])
    return facts


def _block_span(tensor: torch.Tensor) -> int:
    """Bytes from the first to one past the last byte of ``tensor[0]``."""
    block = tensor[0]
    last = sum((size - 1) * stride for size, stride in zip(block.shape, block.stride(), strict=True))
    return (last + 1) * tensor.element_size()


def _runs(name: str, tensor: torch.Tensor, num_blocks: int, layout_name: str) -> list[_Run]:
    """The dense runs of one layer: the whole block if it is dense, else one per head."""
    if tensor.dim() < 2 or tensor.shape[0] != num_blocks:
        raise LayoutError(
            f"KV cache of layer {name!r} ({layout_name}) has shape {tuple(tensor.shape)}: "
            f"kvpipe needs the block dimension ({num_blocks} blocks) first"
        )
    size = tensor.element_size()
    stride = tensor.stride(0) * size
    storage = tensor.untyped_storage()
    if is_dense(tensor[0]):
        return [_Run(name, tensor.data_ptr(), tensor[0].numel() * size, stride, storage)]
    heads = [tensor[:, head] for head in range(tensor.shape[1])]
    if tensor.dim() < 3 or not all(is_dense(head[0]) for head in heads):
        raise LayoutError(
            f"KV cache of layer {name!r} ({layout_name}): a block (shape {tuple(tensor.shape[1:])}, "
            f"strides {tensor.stride()[1:]}) is neither one dense run nor one dense run per head"
        )
    return [_Run(name, head.data_ptr(), head[0].numel() * size, stride, storage) for head in heads]


def _rows(
    storage: torch.UntypedStorage, start: int, nbytes: int, num_blocks: int, stride: int | None = None
) -> torch.Tensor:
    """``num_blocks`` rows of ``nbytes``, ``stride`` (default ``nbytes``) apart, from address ``start`` of
    ``storage``, as uint8, on its device."""
    base = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return base.as_strided((num_blocks, nbytes), (stride or nbytes, 1), start - storage.data_ptr())


def group_layout(
    layers: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], num_blocks: int, layout_name: str = "?"
) -> GroupLayout:
    """The regions an object of a block is made of, from the KV caches of ``layers`` (engine order).

    vLLM's connector builds every storable group's objects from the caches of
    every storable layer, all groups together: in a hybrid model the groups
    overlay the same caches (one layer of each group per cache), so a group's
    block is that block's page in every cache. Pass the same layers to match it.
    ``layout_name`` (vLLM's resolved ``kv_cache_layout``) is only for messages.
    Raises :class:`LayoutError`, naming the layer and the layout, for a cache
    whose blocks cannot be stored as equal-stride rows (see the module's rules).
    """
    runs: list[_Run] = []
    seen: set[tuple[int, int]] = set()
    for name, value in layers.items():
        for run in _runs(name, _representative(name, value), num_blocks, layout_name):
            # Layers of different groups overlay one cache (a block id belongs to one
            # group at a time): the same rows are one region, as vLLM's connector has it.
            if (run.start, run.stride) not in seen:
                seen.add((run.start, run.stride))
                runs.append(run)
    if not runs:
        raise LayoutError(
            f"no KV cache tensor was given for the stored layers ({layout_name}): nothing to store"
        )
    # Runs whose rows overlap share one row (B outermost): the row is their region.
    clusters: list[list[_Run]] = []
    for run in sorted(runs, key=lambda r: r.start):
        last = clusters[-1] if clusters else None
        if last is not None and run.start < last[0].start + last[0].stride:
            last.append(run)
        else:
            clusters.append([run])
    regions: list[tuple[int, EngineRegion]] = []
    order = {id(run): index for index, run in enumerate(runs)}
    for cluster in clusters:
        head = cluster[0]
        names = tuple(dict.fromkeys(run.layer for run in sorted(cluster, key=lambda r: order[id(r)])))
        end = head.start
        for run in cluster:
            if (
                run.stride != head.stride
                or run.start < end
                or run.start + run.nbytes > head.start + head.stride
            ):
                raise LayoutError(
                    f"KV cache of layers {list(names)} ({layout_name}): their blocks overlap or step "
                    f"differently ({run.layer!r}: {run.nbytes} bytes every {run.stride} at +{run.start - head.start}, "
                    f"row {head.stride} bytes); kvpipe cannot name a block's bytes"
                )
            end = run.start + run.nbytes
        storage = head.storage
        if head.start + num_blocks * head.stride > storage.data_ptr() + storage.nbytes():
            raise LayoutError(
                f"KV cache of layers {list(names)} ({layout_name}): {num_blocks} rows of {head.stride} bytes "
                f"from +{head.start - storage.data_ptr()} run past the end of their {storage.nbytes()}-byte storage"
            )
        rows = _rows(storage, head.start, head.stride, num_blocks)
        first = min(order[id(run)] for run in cluster)
        regions.append((first, EngineRegion(Region(head.start, head.stride), rows, names)))
    return GroupLayout(tuple(region for _, region in sorted(regions, key=lambda pair: pair[0])))


def layer_waves(
    layout: GroupLayout, forward_order: Sequence[str], *, completed: bool = False
) -> tuple[Wave, ...]:
    """Per layer of ``forward_order``, the byte ranges of an object it is the first to need.

    A region belongs to the wave of the first of its layers the forward runs (a
    cross-layer row: the first layer's), what a load must have in by then; with
    ``completed``, to the last (a cross-layer row: the last layer's), when a save
    may read it. Ranges that meet are one. Raises :class:`LayoutError` for a region
    of a layer ``forward_order`` does not name.
    """
    position = {name: index for index, name in enumerate(forward_order)}
    waves: list[list[tuple[int, int]]] = [[] for _ in forward_order]
    offset = 0
    for engine_region in layout.regions:
        unknown = [name for name in engine_region.layers if name not in position]
        if unknown:
            raise LayoutError(f"KV cache of layers {unknown}: not among the layers the forward runs")
        owners = [position[name] for name in engine_region.layers]
        ranges = waves[max(owners) if completed else min(owners)]
        size = engine_region.region.bytes_per_block
        if ranges and sum(ranges[-1]) == offset:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + size)
        else:
            ranges.append((offset, size))
        offset += size
    return tuple(tuple(ranges) for ranges in waves)


def storages_of(values: Sequence[torch.Tensor | Sequence[torch.Tensor]]) -> dict[int, int]:
    """Each distinct storage under ``values``: address -> bytes, what the store registers once."""
    storages: dict[int, int] = {}
    for value in values:
        for tensor in [value] if isinstance(value, torch.Tensor) else value:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def _dense_runs(block: torch.Tensor) -> list[tuple[int, int]]:
    """(byte offset, bytes) of the gapless runs ``block``'s elements make, in memory order."""
    dims = sorted(
        ((size, stride) for size, stride in zip(block.shape, block.stride(), strict=True) if size > 1),
        key=lambda dim: -dim[1],
    )
    inner = 1  # elements of the dense innermost dims
    while dims and dims[-1][1] == inner:
        inner *= dims.pop()[0]
    size = block.element_size()
    offsets = [0]
    for count, stride in dims:
        offsets = [offset + index * stride for offset in offsets for index in range(count)]
    return [(offset * size, inner * size) for offset in offsets]


def shard_layouts(
    layers: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
    num_blocks: int,
    block_size: int,
    shards: int,
    layout_name: str = "?",
) -> tuple[GroupLayout, ...]:
    """The regions of each of ``shards`` store shards of a rank's heads (:mod:`.store_format`), in shard order.

    A store shard's object for a block is its heads' bytes of that block in every
    layer, layer by layer, each layer's in memory order: what vLLM's connector puts
    for a TP-sharded store (``LBHNCStoreLayout``: one run per layer, ``LBNHCStoreLayout``:
    one per token). Each run is a region that steps by the layer's block stride.
    Raises :class:`LayoutError`, naming the layer, for a cache that is not
    ``[num_blocks, heads, block_size, content]`` with heads that divide by ``shards``.
    """
    per_shard: list[list[EngineRegion]] = [[] for _ in range(shards)]
    for name, value in layers.items():
        tensor = _representative(name, value)
        if tensor.dim() != 4 or tensor.shape[0] != num_blocks or tensor.shape[2] != block_size:
            raise LayoutError(
                f"KV cache of layer {name!r} ({layout_name}) has shape {tuple(tensor.shape)}: store TP "
                f"sharding needs [{num_blocks} blocks, heads, {block_size} tokens, content]"
            )
        heads = tensor.shape[1]
        if heads % shards:
            raise LayoutError(
                f"KV cache of layer {name!r} ({layout_name}): {heads} KV heads cannot be split "
                f"into {shards} store shards"
            )
        width = heads // shards
        stride = tensor.stride(0) * tensor.element_size()
        storage = tensor.untyped_storage()
        for shard, regions in enumerate(per_shard):
            block = tensor[0, shard * width : (shard + 1) * width]
            for offset, nbytes in _dense_runs(block):
                start = block.data_ptr() + offset
                rows = _rows(storage, start, nbytes, num_blocks, stride)
                region = Region(start, nbytes, 0 if stride == nbytes else stride)
                regions.append(EngineRegion(region, rows, (name,)))
    return tuple(GroupLayout(tuple(regions)) for regions in per_shard)
