"""Integrity: proof that the bytes a load copies into the engine are the bytes their writer put.

A store object holds KV bytes and nothing else (vLLM's connector reads the same
objects, so they stay byte-identical to its own). What proves them is a *seal*:
one small object, written by the data's writer in the same put call, that
vouches for a *span* of objects: up to :data:`SEAL_SPAN` consecutive chunks of
one request in one stream (one store group of one rank), put together. The seal
lies under its *anchor*'s key (the span's earliest chunk) plus
:data:`~.keys.SEAL_SUFFIX`, in the anchor's lifecycle group.

Why spans: every store key costs the client, the master and the receiver the
same work whatever its size (a 48-byte object ~20 us over TCP), so a seal per
object doubled the keys of a save. Why an anchor *before* its objects: chunk
hashes chain, so any reader of a chunk also knows every chunk before it in its
prefix, and can name the seal that may vouch for it: the seals of its stream's
:data:`SEAL_SPAN` - 1 chunks before it and its own (:func:`seal_candidates`),
asked for in one ``batch_is_exist``. The anchor is the chunk a prefix's readers
share most, so its lifecycle group is the one that lives longest.

A seal holds (:class:`Seal`, :data:`SEAL_SIZE` bytes, little-endian; fixed size,
because a get must name an object's exact size):

``magic`` (8) ``version`` (u16) ``algorithm`` (u16) ``count`` (u16) ``reserved`` (u16)
``fingerprint`` (16), then :data:`SEAL_SPAN` entries of ``key_id`` (u64) ``size`` (u64)
``checksum`` (u64), the first ``count`` used.

- ``key_id`` (:func:`key_id`) is xxh3-64 of the object's full key (model, rank,
  store group, chunk hash): an entry vouches for that one object only.
- ``checksum`` is xxh3-64 of the object's bytes, computed on the copy the put
  reads (a staging slot, or the engine's blocks when nothing is staged). xxh3
  was measured against the others on a 2 MiB object in 16 spans: xxh3 60 us
  (35 GB/s), xxh64 99 us, zlib's crc32 304 us, blake2b 1.5 ms. It is not a
  cryptographic hash: it catches damage (a torn write, a buggy writer, flipped
  bits), not an attacker who can write the store.
- ``fingerprint`` (:func:`fingerprint`) names what decides an object's bytes
  (dtypes, per-layer block shapes and layout, block sizes, layers, the model's
  revision). Two engines of one model name but another dtype make objects of
  the same key and size; the fingerprint tells them apart.

What a load makes of an object and the seal that vouches for it is a
:class:`Verdict`. An object no seal vouches for (written by vLLM's connector, or
its seal evicted) is ``unverified``: loaded under ``integrity: verify``, refused
under ``required``.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import struct
import sys
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import NamedTuple

import xxhash

from .chunks import chunk_hash_at
from .keys import SEAL_SUFFIX, is_seal_key, seal_key, sealed_key
from .model import KVCache, StoreObject

__all__ = [
    "FINGERPRINT_BYTES",
    "REFUSED",
    "SEAL_SIZE",
    "SEAL_SPAN",
    "SEAL_SUFFIX",
    "Integrity",
    "Seal",
    "SealEntry",
    "Verdict",
    "Vouch",
    "checksum",
    "engine_facts",
    "entry_of",
    "fingerprint",
    "is_seal_key",
    "judge",
    "key_id",
    "key_stem",
    "seal_candidates",
    "seal_key",
    "seal_spans",
    "sealed_key",
]

SEAL_MAGIC = b"KVPSEAL\x00"
SEAL_VERSION = 2  # 1: one seal per object (48 bytes)
XXH3_64 = 1  # the ``algorithm`` field: the only one so far
#: the most chunks one seal vouches for. More would cut keys further (16 chunks: a
#: sixteenth of the keys), but a reader asks for this many seals before its first
#: chunk, and a writer that dies mid-span leaves this many chunks unverified.
SEAL_SPAN = 16
_HEADER = struct.Struct("<8sHHHH16s")
_ENTRY = struct.Struct("<QQQ")
SEAL_SIZE = _HEADER.size + SEAL_SPAN * _ENTRY.size  # 416
#: per entry count, the whole seal as one struct, its unused entries as zero padding: packed in
#: one call, a 2-entry seal took 0.65 us against 1.05 for a header, each entry and a zero fill apart
_SEALS = tuple(
    struct.Struct(_HEADER.format + _ENTRY.format[1:] * count + f"{(SEAL_SPAN - count) * _ENTRY.size}x")
    for count in range(SEAL_SPAN + 1)
)
FINGERPRINT_BYTES = 16


class Integrity(StrEnum):
    """How strictly loads check what they read (the ``integrity`` setting).

    ``off``: no seals are written or read (the behaviour before seals; an object
    is checked for its size only). ``verify``: every put writes seals, every
    load checks the one that vouches for its object where it exists and loads
    an unsealed object as unverified. ``required``: as ``verify``, but a chunk
    no seal may vouch for is a miss.
    """

    OFF = "off"
    VERIFY = "verify"
    REQUIRED = "required"


class Verdict(StrEnum):
    """What a load found an object to be; every verdict but the first two fails the block."""

    VERIFIED = "verified"
    UNVERIFIED = "unverified"  # no seal: vLLM's connector wrote it, or the seal is gone
    CORRUPT = "corrupt"  # its bytes are not the bytes its seal describes, or its seal is damaged: removed
    FOREIGN = "foreign"  # written by an engine of another configuration (fingerprint)
    UNSEALED = "unsealed"  # no seal, and ``integrity: required``


#: the verdicts whose object is never copied into the engine's view (its block fails)
REFUSED = frozenset({Verdict.CORRUPT, Verdict.FOREIGN, Verdict.UNSEALED})


class SealEntry(NamedTuple):
    """What a seal says of one object: which (:func:`key_id`), how many bytes, their checksum."""

    key_id: int
    size: int
    checksum: int


class Seal(NamedTuple):
    """One seal's content (see the module docstring for the bytes): a fingerprint and its span's entries."""

    fingerprint: bytes
    entries: tuple[SealEntry, ...]

    def pack(self) -> bytes:
        buffer = bytearray(SEAL_SIZE)
        self.pack_into(memoryview(buffer), 0)
        return bytes(buffer)

    def pack_into(self, buffer: memoryview, offset: int) -> None:
        """Write the seal's bytes into ``buffer`` at ``offset`` (no intermediate bytes: a put's hot path).

        :raises ValueError: more entries than :data:`SEAL_SPAN`.
        """
        count = len(self.entries)
        if count > SEAL_SPAN:
            raise ValueError(f"a seal holds at most {SEAL_SPAN} entries, got {count}")
        _SEALS[count].pack_into(
            buffer,
            offset,
            SEAL_MAGIC,
            SEAL_VERSION,
            XXH3_64,
            count,
            0,
            self.fingerprint,
            *itertools.chain.from_iterable(self.entries),
        )

    @classmethod
    def unpack(cls, data: bytes) -> Seal | None:
        """The seal in ``data``; None for bytes that are no seal of this format (damaged, or another tool's)."""
        if len(data) != SEAL_SIZE:
            return None
        magic, version, algorithm, count, _, fingerprint_ = _HEADER.unpack_from(data)
        if magic != SEAL_MAGIC or version != SEAL_VERSION or algorithm != XXH3_64 or count > SEAL_SPAN:
            return None
        entries = tuple(
            SealEntry(*_ENTRY.unpack_from(data, _HEADER.size + index * _ENTRY.size)) for index in range(count)
        )
        return cls(fingerprint_, entries)

    @staticmethod
    def of_another_version(data: bytes) -> bool:
        """Whether ``data`` begins as a kvpipe seal of another format version (an older or newer kvpipe's)."""
        return len(data) >= _HEADER.size and data[: len(SEAL_MAGIC)] == SEAL_MAGIC and (
            _HEADER.unpack_from(data)[1] != SEAL_VERSION
        )


def key_id(key: str) -> int:
    """The id a seal's entry names an object by: xxh3-64 of its whole key."""
    return xxhash.xxh3_64_intdigest(key.encode())


#: The process's whole address space as one byte buffer: a span's bytes are a slice of it.
#: Slicing costs a fraction of making a ctypes array per span (16 KiB in one span: 0.62 us
#: hashed against 1.09; in four of 4 KiB: 1.4 against 3.5). Reading it is reading memory by
#: address, as the store's own calls do: only live spans are ever sliced.
_MEMORY = memoryview((ctypes.c_char * sys.maxsize).from_address(0)).cast("B")


def checksum(addresses: Sequence[int], sizes: Sequence[int]) -> int:
    """xxh3-64 of the bytes at ``addresses`` (``sizes`` each), concatenated: one object's bytes.

    Reads process memory: the spans must be live host memory (a staging slot, a
    CPU cache's blocks), as for the store's own calls.
    """
    if len(addresses) == 1:  # a staged object: one span, hashed in one call
        return xxhash.xxh3_64_intdigest(_MEMORY[addresses[0] : addresses[0] + sizes[0]])
    digest = xxhash.xxh3_64()
    for address, size in zip(addresses, sizes, strict=True):
        digest.update(_MEMORY[address : address + size])
    return digest.intdigest()


def fingerprint(kv: KVCache) -> bytes:
    """What decides the bytes of ``kv``'s objects, hashed to :data:`FINGERPRINT_BYTES`.

    The cache's own shape (per store group: its kind, block size and object
    size) and the facts its engine adds (``KVCache.byte_facts``: dtypes,
    per-layer block shapes, layout, revision). Addresses, block counts and how
    an object is split into buffers are left out: they differ between engines
    (and between a save's staging slots and a load's blocks) whose bytes agree.
    """
    layouts = kv.shards[0].layouts if kv.shards else {}
    groups = [
        [spec.kind.value, spec.block_size, layouts[index].object_size if index in layouts else None]
        for index, spec in enumerate(kv.groups)
        if spec.prefix_cacheable
    ]
    facts = {"seal": SEAL_VERSION, "groups": groups, "engine": dict(kv.byte_facts)}
    encoded = json.dumps(facts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(encoded, digest_size=FINGERPRINT_BYTES).digest()


def entry_of(
    key: str, addresses: Sequence[int], sizes: Sequence[int], known: int | None = None
) -> SealEntry:
    """A seal's entry for the object ``key`` whose bytes lie at ``addresses``/``sizes``.

    ``known``: their :func:`checksum`, if it was taken already (as they were staged).
    """
    return SealEntry(key_id(key), sum(sizes), checksum(addresses, sizes) if known is None else known)


class Vouch(NamedTuple):
    """The seal that vouches for an object: its fingerprint, and its entry for the object."""

    fingerprint: bytes
    entry: SealEntry


def judge(
    vouch: Vouch | None,
    addresses: Sequence[int],
    sizes: Sequence[int],
    fingerprint_: bytes | None,
    mode: Integrity,
    damaged_seal: bool = False,
) -> Verdict:
    """The verdict on an object read into ``addresses``/``sizes``, given the seal entry that vouches for it.

    ``vouch`` None: no seal names it; then ``damaged_seal`` says a seal that may
    have (one of its candidates, :func:`seal_candidates`) could not be read as
    one, and the object is as suspect as a damaged seal can make it.
    The fingerprint is compared before the checksum: bytes of another
    configuration are intact, only not ours, and must not be removed as damage.
    ``fingerprint_`` None (a scrubber, which knows no engine) checks the bytes only.
    """
    if vouch is None:
        if damaged_seal:
            return Verdict.CORRUPT
        return Verdict.UNSEALED if mode is Integrity.REQUIRED else Verdict.UNVERIFIED
    if fingerprint_ is not None and vouch.fingerprint != fingerprint_:
        return Verdict.FOREIGN
    if vouch.entry.size != sum(sizes) or vouch.entry.checksum != checksum(addresses, sizes):
        return Verdict.CORRUPT
    return Verdict.VERIFIED


def key_stem(key: str, chunk_hash: bytes) -> str:
    """Everything of an object's key but its chunk hash: its stream (model, rank, store group)."""
    return key[: len(key) - 2 * len(chunk_hash)]


def seal_spans(records: Sequence[StoreObject]) -> list[list[int]]:
    """The spans one put call's ``records`` are sealed in: positions into ``records``, the anchor first.

    A span is records of one request and one stream whose chunks lie within
    :data:`SEAL_SPAN` chunks from the anchor, the earliest of them: a reader of
    any of them meets the anchor's chunk in its own prefix (:func:`seal_candidates`).
    Records of two requests never share a span: their prefixes may part after
    the anchor.
    """
    streams: dict[tuple[str, str], list[int]] = {}
    for position, record in enumerate(records):
        stream = (record.request_id, key_stem(record.key, record.chunk_hash))
        if (members := streams.get(stream)) is None:
            streams[stream] = [position]
        else:
            members.append(position)
    spans: list[list[int]] = []
    for members in streams.values():
        if len(members) > 1:
            members.sort(key=lambda position: records[position].chunk_index)
        span: list[int] = []
        for position in members:
            if span and (
                len(span) == SEAL_SPAN or records[position].chunk_index >= records[span[0]].chunk_index + SEAL_SPAN
            ):
                spans.append(span)
                span = []
            span.append(position)
        spans.append(span)
    return spans


def seal_candidates(
    key: str,
    chunk_hash: bytes,
    chunk_index: int,
    block_size: int,
    block_hashes: Sequence[bytes],
    hash_block_size: int,
) -> list[str]:
    """The keys of the seals that may vouch for the object ``key`` (chunk ``chunk_index`` of its stream).

    Its own (it may anchor a span) and those of the whole chunks of its stream
    up to :data:`SEAL_SPAN` - 1 before it, nearest first: an anchor is never
    further back (:func:`seal_spans`). ``block_hashes`` are its request's.
    """
    stem = key_stem(key, chunk_hash)
    earliest = max(0, chunk_index - SEAL_SPAN + 1)
    return [seal_key(key)] + [
        seal_key(stem + chunk_hash_at(block_hashes, (index + 1) * block_size, hash_block_size).hex())
        for index in range(chunk_index - 1, earliest - 1, -1)
    ]


def engine_facts(facts: Mapping[str, object]) -> tuple[tuple[str, str], ...]:
    """``facts`` as ``KVCache.byte_facts`` holds them: sorted (name, text) pairs."""
    return tuple(sorted((name, json.dumps(value, sort_keys=True, default=str)) for name, value in facts.items()))
