"""Layers as byte ranges of an object: what a layer-wise load reads, and in which order.

A store object is a block's bytes in every region of its group, region after
region in the engine's layer order (:class:`~.model.BlockLayout`), which is the
value vLLM's connector writes. So the bytes one attention layer reads are one or
a few byte ranges of the object, and an object can be read layer by layer into
the engine while the forward computes the layers before, and stay one key,
byte-identical to the object written or read whole.

:data:`LayerWaves` says, per engine group, which ranges each layer needs that no
layer before it needed (a *wave*): for a per-layer cache one range per layer (two
where K and V lie apart); for a cache whose block holds every layer (a
cross-layer layout) the first wave is the whole object and the rest are empty. A
layer-wise load reads wave 0 of every object, then wave 1, and so on; the engine
waits before layer ``i`` for wave ``i`` only (docs/layerwise.md).

- :func:`wave_pieces`: a wave's ranges mapped onto the buffers a record lands in
  (they tile the object in order, whatever their split), as the ranged get takes them.
- :class:`GetSessions`: the store's get sessions, counted per key. A ranged get
  reads only keys in a session, and a session is one per key per client (the
  first end closes it for every reader), so two loads of one chunk in flight
  must not end each other's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .model import Buffer, KVCache, LayerWaves, Wave

__all__ = ["GetSessions", "LayerWaves", "Wave", "common_waves", "wave_pieces"]


def common_waves(kv: KVCache) -> tuple[Wave, ...]:
    """The waves every group of ``kv`` shares (a hybrid model's groups overlay one cache); none if they differ."""
    found = set(kv.layer_waves.values())
    return found.pop() if len(found) == 1 else ()


def wave_pieces(buffers: Sequence[Buffer], wave: Wave) -> tuple[list[int], list[int], list[int]]:
    """Where ``wave``'s bytes land: (destination pointers, sizes, offsets in the object), one per piece.

    ``buffers`` tile the object in order (a record's, as the whole get takes them);
    a range that spans two buffers becomes two pieces. Raises ValueError for a
    range past the buffers' end.
    """
    ptrs: list[int] = []
    sizes: list[int] = []
    offsets: list[int] = []
    starts: list[int] = []
    total = 0
    for buffer in buffers:
        starts.append(total)
        total += buffer.size
    for offset, size in wave:
        if offset < 0 or offset + size > total:
            raise ValueError(f"range ({offset}, {size}) lies outside an object of {total} bytes")
        end = offset + size
        for start, buffer in zip(starts, buffers, strict=True):
            low, high = max(offset, start), min(end, start + buffer.size)
            if low < high:
                ptrs.append(buffer.address + low - start)
                sizes.append(high - low)
                offsets.append(low)
    return ptrs, sizes, offsets


class GetSessions:
    """How many loads of a stage read each key in a session, so the store's session is opened and closed once.

    Used on one event loop (a stage's), so it needs no lock. The store calls are
    the caller's: it opens the keys :meth:`to_open` names, tells :meth:`joined`
    the keys it now reads in a session, and closes those :meth:`left` names.
    """

    def __init__(self) -> None:
        self._readers: Counter[str] = Counter()

    def to_open(self, keys: Sequence[str]) -> list[str]:
        """The keys of ``keys`` (once each) that no load reads in a session yet."""
        return [key for key in dict.fromkeys(keys) if not self._readers[key]]

    def joined(self, keys: Sequence[str]) -> None:
        """One load more reads each of ``keys`` (each once) in a session."""
        self._readers.update(list(dict.fromkeys(keys)))

    def left(self, keys: Sequence[str]) -> list[str]:
        """One load less reads each of ``keys`` (as :meth:`joined` named them); the keys nobody reads now."""
        closing = []
        for key in dict.fromkeys(keys):
            self._readers[key] -= 1
            if self._readers[key] <= 0:
                del self._readers[key]
                closing.append(key)
        return closing
