"""Layer seals: a checksum per layer of each sealed object, so a layer-wise load checks a layer before its attention.

A seal (:mod:`.integrity`) vouches for an object whole, so a load can judge the
object only once every byte of it is in. A layer-wise load (:mod:`.layers`)
hands the engine each layer as it lands; so beside each seal its writer puts a
*layer seal*: for each object the seal names, the checksum of each of its waves
(the byte ranges one layer of the forward is the first to read). It lies under
the anchor's key plus :data:`~.keys.LAYER_SEAL_SUFFIX`, in the anchor's
lifecycle group, put in the same call as its seal.

An entry names its object by key id *and* by the object's whole checksum, which
binds it to the seal entry that vouches for the same bytes: a layer seal another
writer left (the race :mod:`.integrity` describes) matches no vouching entry and
is not used. A reader whose object a seal vouches for without a matching layer
seal (an older kvpipe, a writer that knew no layers, a layer seal evicted) reads
that object whole and judges it before the forward.

Bytes (little-endian; fixed size for a number of waves, :func:`layer_seal_size`,
because a get names an object's exact size): ``magic`` (8) ``version`` (u16)
``algorithm`` (u16) ``count`` (u16) ``waves`` (u16), then :data:`~.integrity.SEAL_SPAN`
entries of ``key_id`` (u64), ``checksum`` (u64, the whole object's) and ``waves``
checksums (u64 each), the first ``count`` used.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

from .integrity import SEAL_SPAN, XXH3_64, checksum, key_id
from .layers import wave_pieces
from .model import Buffer, Wave

LAYER_SEAL_MAGIC = b"KVPLAYRS"
LAYER_SEAL_VERSION = 1
_HEADER = struct.Struct("<8sHHHH")


def layer_seal_size(waves: int) -> int:
    """The bytes of a layer seal of objects of ``waves`` waves."""
    return _HEADER.size + SEAL_SPAN * (16 + 8 * waves)


class LayerEntry(NamedTuple):
    """What a layer seal says of one object: which, its whole checksum, and each wave's."""

    key_id: int
    checksum: int
    waves: tuple[int, ...]


def layer_entry_of(key: str, buffers: Sequence[Buffer], whole: int, waves: Sequence[Wave]) -> LayerEntry:
    """A layer seal's entry for the object ``key`` whose bytes lie in ``buffers`` (``whole``: their checksum)."""
    sums = []
    for wave in waves:
        addresses, sizes, _ = wave_pieces(buffers, wave)
        sums.append(checksum(addresses, sizes) if addresses else 0)
    return LayerEntry(key_id(key), whole, tuple(sums))


def pack_into(entries: Sequence[LayerEntry], waves: int, buffer: memoryview) -> None:
    """Write a layer seal of ``entries`` (each of ``waves`` waves) into ``buffer`` (:func:`layer_seal_size` bytes).

    :raises ValueError: more entries than :data:`~.integrity.SEAL_SPAN`, or an entry of another number of waves.
    """
    if len(entries) > SEAL_SPAN or any(len(entry.waves) != waves for entry in entries):
        raise ValueError(f"a layer seal holds at most {SEAL_SPAN} entries of {waves} waves each")
    buffer[: layer_seal_size(waves)] = bytes(layer_seal_size(waves))
    _HEADER.pack_into(buffer, 0, LAYER_SEAL_MAGIC, LAYER_SEAL_VERSION, XXH3_64, len(entries), waves)
    entry = struct.Struct(f"<QQ{waves}Q")
    for index, (key, whole, sums) in enumerate(entries):
        entry.pack_into(buffer, _HEADER.size + index * entry.size, key, whole, *sums)


def unpack(data: bytes, waves: int) -> dict[int, LayerEntry] | None:
    """The entries of the layer seal in ``data`` by key id; None for bytes that are none of ``waves`` waves."""
    if len(data) != layer_seal_size(waves):
        return None
    magic, version, algorithm, count, stored_waves = _HEADER.unpack_from(data)
    if magic != LAYER_SEAL_MAGIC or version != LAYER_SEAL_VERSION or algorithm != XXH3_64:
        return None
    if count > SEAL_SPAN or stored_waves != waves:
        return None
    entry = struct.Struct(f"<QQ{waves}Q")
    found = {}
    for index in range(count):
        key, whole, *sums = entry.unpack_from(data, _HEADER.size + index * entry.size)
        found[key] = LayerEntry(key, whole, tuple(sums))
    return found


def wave_intact(entry: LayerEntry, wave: int, buffers: Sequence[Buffer], ranges: Wave) -> bool:
    """Whether ``ranges`` of the object read into ``buffers`` hold the bytes ``entry`` says wave ``wave`` had."""
    addresses, sizes, _ = wave_pieces(buffers, ranges)
    return (checksum(addresses, sizes) if addresses else 0) == entry.waves[wave]
