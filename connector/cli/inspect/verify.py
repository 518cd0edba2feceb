"""The scrubber: read the model's seals and objects through a Mooncake client, judge them, repair.

Why: the admin HTTP says what is stored, not whether it is what its writer
wrote. A client that mounts no segment first reads every seal of the model (a
seal vouches for a span of objects, :mod:`kvpipe.stages.integrity`; they are
small), then the objects in bounded ``batch_get_into_multi_buffers`` calls, and
judges each object's bytes against the entry that names it
(:func:`~kvpipe.stages.integrity.judge`); :mod:`.figures` says what each verdict means.
"""

from __future__ import annotations

import ctypes
import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

from kvpipe.connector.store.configs import MooncakeStoreConfig, connect
from kvpipe.connector.store.mooncake import MasterError, MooncakeError
from kvpipe.connector.store.mooncake.admin import Replica
from kvpipe.connector.store.protocol import Store
from kvpipe.pipeline.config import one_line
from kvpipe.stages import MAX_BUFFERS_PER_CALL
from kvpipe.stages.integrity import SEAL_SIZE, Integrity, Verdict, judge
from kvpipe.stages.keys import key_chunk_hex, seal_key
from kvpipe.stages.store import EXISTS, Code, describe
from kvpipe.stages.vouching import DAMAGED, SealPlace, Vouchers, size_unknown

from .errors import InspectError
from .figures import SCRUB_VERDICTS, NodeFigures, Verification

__all__ = ["PROGRESS_EVERY", "SCRUB_CALL_BYTES", "Scrub", "scrub_client", "verify_keys", "verify_objects"]

#: bytes of objects one verifying read brings at most (one registered buffer of this size, reused)
SCRUB_CALL_BYTES = 64 << 20
#: a verification reports its progress every this many objects read
PROGRESS_EVERY = 5000
_VERDICT_NAMES = {Verdict.VERIFIED: "ok", Verdict.CORRUPT: "corrupt", Verdict.UNVERIFIED: "unverified"}


@contextmanager
def scrub_client(config: MooncakeStoreConfig) -> Iterator[Store]:
    """A client of the store ``config`` names that mounts no segment (kvpipe's :func:`connect`), closed on exit.

    :raises InspectError: (``verify``) it cannot be opened.
    """
    try:
        store = connect(config, mount_segment=False)
    except (MasterError, MooncakeError) as error:
        raise InspectError(
            "verify", f"no Mooncake client opens on the master at {config.master}: {one_line(str(error))}"
        ) from None
    try:
        yield store
    finally:
        store.close()


@dataclass(frozen=True)
class Scrub:
    """What verifying asks: read objects through ``store`` (a :func:`scrub_client`) and judge them.

    ``sample``: that many of the model's objects, drawn at random (None: every
    one). ``repair``: remove the chunks found corrupt. ``on_progress(read, total)``
    is called every :data:`PROGRESS_EVERY` objects read.
    """

    store: Store
    sample: int | None = None
    repair: bool = False
    on_progress: Callable[[int, int], None] | None = None


class _Read(NamedTuple):
    """One object's verdict, with why it is unreadable or the fingerprint its seal names."""

    verdict: str
    reason: str | None = None
    fingerprint: str | None = None


def verify_objects(
    scrub: Scrub,
    present: Mapping[str, Sequence[Replica]],
    seals: Sequence[str],
    chunk_of: Mapping[str, bytes],
    nodes: Sequence[NodeFigures],
) -> Verification:
    """Read and judge the objects ``scrub`` asks for, count each verdict on the nodes of its replicas; repair.

    ``present``: the model's stored objects and their replicas; ``seals``: its
    stored seals; ``chunk_of``: the chunk of each of the model's objects and
    seals. Each node's ``verify`` is set.

    :raises InspectError: (``verify``) the read memory cannot be registered with the store.
    """
    keys = sorted(present)
    if scrub.sample is not None and scrub.sample < len(keys):
        keys = sorted(random.sample(keys, scrub.sample))
    verification = Verification(scrub.sample)
    tally = {node.endpoint: Counter[str]() for node in nodes}
    size = {key: present[key][0].size for key in keys}
    for key, read in _read_all(scrub, keys, size, seals, verification):
        verification.verdicts[read.verdict] += 1
        if read.reason is not None:
            verification.unreadable_reasons[read.reason] += 1
        if read.fingerprint is not None:
            verification.fingerprints[read.fingerprint] += 1
        if read.verdict == "corrupt":
            verification.corrupt_keys.append(key)
        for endpoint in {copy.endpoint for copy in present[key]}:
            tally[endpoint][read.verdict] += 1
    for node in nodes:
        node.verify = {name: tally[node.endpoint][name] for name in SCRUB_VERDICTS}
    corrupt = {chunk_of[key] for key in verification.corrupt_keys}
    verification.corrupt_chunks = len(corrupt)
    if scrub.repair:
        _repair(scrub.store, sorted(key for key, chunk in chunk_of.items() if chunk in corrupt), verification)
    return verification


def verify_keys(scrub: Scrub, keys: Iterable[str]) -> Verification:
    """:func:`verify_objects` on those of the objects ``keys`` that ``scrub.store`` still holds: any store.

    For a store with no admin HTTP to list it (the in-process memory store, a
    ``kvpipe run``'s): which objects are present and their sizes are asked of the
    store itself, and so are their seals, every one of which lies under the key of
    an object its writer offered (its span's anchor, :mod:`kvpipe.stages.integrity`).
    So give every key a writer offered, stored or not: a seal may outlive its anchor.
    The store counts as one node, of endpoint ``""``.
    """
    keys = list(dict.fromkeys(keys))
    present = _existing(scrub.store, keys)
    seals = _existing(scrub.store, [seal_key(key) for key in keys])
    node = NodeFigures(None, "")
    replicas = {key: [Replica(scrub.store.get_size(key), node.endpoint)] for key in present}
    chunk_of = {key: bytes.fromhex(key_chunk_hex(key)) for key in [*present, *seals]}
    return verify_objects(scrub, replicas, seals, chunk_of, [node])


def _existing(store: Store, keys: Sequence[str]) -> list[str]:
    """Those of ``keys`` ``store`` holds, asked in calls of :data:`MAX_BUFFERS_PER_CALL` keys."""
    found = []
    for start in range(0, len(keys), MAX_BUFFERS_PER_CALL):
        call = keys[start : start + MAX_BUFFERS_PER_CALL]
        found += [key for key, answer in zip(call, store.batch_is_exist(call), strict=True) if answer == EXISTS]
    return found


def _read_all(
    scrub: Scrub, keys: Sequence[str], size: Mapping[str, int], seals: Sequence[str], verification: Verification
) -> Iterator[tuple[str, _Read]]:
    """Each of ``keys`` (of ``size`` bytes) read and judged by ``seals``; counts what is read and reports progress.

    A call holds at most :data:`MAX_BUFFERS_PER_CALL` buffers and
    :data:`SCRUB_CALL_BYTES` of objects (or one object larger than that).

    :raises InspectError: (``verify``) the read memory cannot be registered with the store.
    """
    data_bytes = max(min(sum(size.values()), SCRUB_CALL_BYTES), max(size.values(), default=0))
    seal_bytes = min(len(seals), MAX_BUFFERS_PER_CALL) * SEAL_SIZE
    with _registered(scrub.store, max(data_bytes, seal_bytes, 1)) as base:
        vouchers, unreadable_seals = _read_seals(scrub.store, seals, base)
        for call in _calls(keys, size, MAX_BUFFERS_PER_CALL, data_bytes):
            addresses = list(itertools.accumulate((size[key] for key in call[:-1]), initial=base))
            results = scrub.store.batch_get_into_multi_buffers(
                call, [[address] for address in addresses], [[size[key]] for key in call]
            )
            for key, address, result in zip(call, addresses, results, strict=True):
                yield key, _judge_read(key, size[key], address, result, vouchers, unreadable_seals)
            before, verification.objects = verification.objects, verification.objects + len(call)
            if (
                scrub.on_progress is not None
                and verification.objects // PROGRESS_EVERY > before // PROGRESS_EVERY
            ):
                scrub.on_progress(verification.objects, len(keys))
            verification.bytes += sum(size[key] for key in call)


def _read_seals(store: Store, seals: Sequence[str], base: int) -> tuple[Vouchers, dict[str, str]]:
    """Every seal of ``seals`` read through memory at ``base``: what they vouch for, and those not read as seals.

    The second holds, per seal key, :data:`~kvpipe.stages.vouching.DAMAGED` (no seal
    of ours: its anchor object is corrupt, as a load judges it) or why it could not be read.
    A seal of another format (another kvpipe's) is neither: its objects are unverified.
    """
    vouchers = Vouchers()
    unreadable: dict[str, str] = {}
    for start in range(0, len(seals), MAX_BUFFERS_PER_CALL):
        call = seals[start : start + MAX_BUFFERS_PER_CALL]
        addresses = [base + index * SEAL_SIZE for index in range(len(call))]
        results = store.batch_get_into_multi_buffers(
            call, [[address] for address in addresses], [[SEAL_SIZE]] * len(call)
        )
        for key, address, result in zip(call, addresses, results, strict=True):
            data = ctypes.string_at(address, SEAL_SIZE) if result == SEAL_SIZE else None
            stored = store.get_size(key) if size_unknown(result) else None
            if (problem := vouchers.add(key, SealPlace(key, 0), result, data, stored)) is not None:
                unreadable[key] = problem
    return vouchers, unreadable


def _repair(store: Store, doomed: Sequence[str], verification: Verification) -> None:
    """Remove ``doomed`` (the corrupt chunks' objects and seals), forced: the reads leased them."""
    codes = [store.remove(key, force=True) for key in doomed]
    verification.removed = sum(code == 0 for code in codes)
    verification.remove_failures = sum(code not in (0, Code.NOT_FOUND) for code in codes)


def _judge_read(
    key: str, size: int, address: int, read: int, vouchers: Vouchers, unreadable_seals: Mapping[str, str]
) -> _Read:
    """The verdict on the object ``key`` of ``size`` bytes read to ``address`` (``read``: the call's result).

    An object no seal names is unverified, unless its own seal (it anchored a
    span) was damaged: then it is corrupt, as a load judges it.
    """
    if read != size:
        return _Read("unreadable", describe(read) if read < 0 else f"read {read} bytes, not {size}")
    found = vouchers.vouch_for(key)
    problem = unreadable_seals.get(seal_key(key)) if found is None else None
    if problem not in (None, DAMAGED):
        return _Read("unreadable", f"its seal: {problem}")
    vouch = None if found is None else found[0]
    verdict = judge(vouch, [address], [size], None, Integrity.VERIFY, damaged_seal=problem == DAMAGED)
    return _Read(_VERDICT_NAMES[verdict], fingerprint=None if vouch is None else vouch.fingerprint.hex())


def _calls(keys: Sequence[str], size: Mapping[str, int], objects: int, nbytes: int) -> Iterator[list[str]]:
    """Runs of ``keys`` of at most ``objects`` keys and ``nbytes`` bytes (a larger object alone)."""
    call: list[str] = []
    used = 0
    for key in keys:
        if call and (len(call) == objects or used + size[key] > nbytes):
            yield call
            call, used = [], 0
        call.append(key)
        used += size[key]
    if call:
        yield call


@contextmanager
def _registered(store: Store, nbytes: int) -> Iterator[int]:
    """The address of ``nbytes`` of memory registered with ``store`` (a transfer touches only such memory).

    :raises InspectError: (``verify``) the store refuses to register it.
    """
    buffer = ctypes.create_string_buffer(nbytes)
    address = ctypes.addressof(buffer)
    code = store.register_buffer(address, nbytes)
    if code != 0:
        raise InspectError(
            "verify", f"registering {nbytes} bytes of read memory with the store failed: {describe(code)}"
        )
    try:
        yield address
    finally:
        store.unregister_buffer(address)
