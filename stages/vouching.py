"""Which seal vouches for which object: what a reader makes of the seals it read.

A seal vouches for a span of chunks of one stream, anchored at the span's
earliest chunk (:mod:`.integrity`). A reader asks for the seals that may vouch
for its objects (:func:`~.integrity.seal_candidates`), reads those that exist,
and then needs, per object: the entry that names it (by :func:`~.integrity.key_id`),
and, where none does, whether a seal that may have could not be read, as a seal
(damaged: the object is as suspect as its seal) or at all (a failed transfer:
nothing is known of the object). :class:`Vouchers` holds that, built on the
loop from the call's answers, read from the worker threads that judge.

A seal key that holds another size, or a seal of another format version, was
written by another kvpipe (one upgraded, or not yet) or another tool: it says
nothing of the bytes, as a missing seal says nothing, so its objects load
unverified (refused under ``integrity: required``) and nothing is removed for it.
Mooncake answers a destination larger than the object as a failed transfer
(-800), so for a seal read that failed so the reader asks the object's size.
"""

from __future__ import annotations

from typing import NamedTuple

from .integrity import SEAL_SIZE, SEAL_SPAN, Seal, Vouch, key_id, key_stem
from .model import StoreObject
from .store import Code, describe

__all__ = ["DAMAGED", "SealPlace", "Vouchers", "Witness", "size_unknown"]

#: what :attr:`Witness.problem` says of a seal that is there but no seal of ours
DAMAGED = "damaged"


def size_unknown(result: int) -> bool:
    """Whether a seal read's answer hides the object's size, so the reader asks it (:meth:`Vouchers.add`'s
    ``stored_size``): a seal of another, smaller format reads as a failed transfer."""
    return result == Code.TRANSFER_FAILED


def _another_format(result: int, data: bytes | None, stored_size: int | None) -> bool:
    """Whether a seal read found another size (larger: ``INVALID_PARAMS``; smaller: ``stored_size``) or version."""
    if result == SEAL_SIZE:
        return data is not None and Seal.of_another_version(data)
    if result == Code.INVALID_PARAMS or 0 <= result:
        return True
    return stored_size is not None and stored_size >= 0 and stored_size != SEAL_SIZE


class SealPlace(NamedTuple):
    """Where a seal key sits: its stream (:func:`~.integrity.key_stem`) and its anchor's chunk index."""

    stem: str
    anchor_index: int


class Witness(NamedTuple):
    """What the seals read say of one object.

    ``vouch``: the entry that names it (None: none does). ``seal``: the key of the
    seal that vouches for it, or of the damaged one that may have. ``problem``: where no seal vouches, :data:`DAMAGED` if a seal
    that may have is no seal, or why one could not be read; None if none could.
    """

    vouch: Vouch | None
    seal: str | None = None
    problem: str | None = None


class Vouchers:
    """The seals one read brought back, indexed for :meth:`witness`."""

    __slots__ = ("_vouches", "_unreadable")

    def __init__(self) -> None:
        #: key id -> the entry naming it, its seal's key and anchor index (the nearest anchor wins)
        self._vouches: dict[int, tuple[Vouch, str, int]] = {}
        self._unreadable: dict[str, list[tuple[int, str, str]]] = {}  # stem -> (anchor index, seal key, why)

    def add(
        self, key: str, place: SealPlace, result: int, data: bytes | None, stored_size: int | None = None
    ) -> str | None:
        """One seal read: ``result`` is the store's answer for ``key``, ``data`` its bytes when it read whole.

        ``stored_size``: the object's size, where the reader asked (a read that failed
        as a transfer). Returns None for a seal read, a missing one or one of another
        format (they say nothing), else the problem: :data:`DAMAGED` for bytes of a
        seal's size that are no seal of ours, or why the read failed.
        """
        if result == Code.NOT_FOUND or _another_format(result, data, stored_size):
            return None
        seal = Seal.unpack(data) if result == SEAL_SIZE and data is not None else None
        if seal is not None:
            for entry in seal.entries:
                held = self._vouches.get(entry.key_id)
                if held is None or place.anchor_index > held[2]:
                    self._vouches[entry.key_id] = (Vouch(seal.fingerprint, entry), key, place.anchor_index)
            return None
        why = DAMAGED if result >= 0 else describe(result)
        self._unreadable.setdefault(place.stem, []).append((place.anchor_index, key, why))
        return why

    def vouch_for(self, key: str) -> tuple[Vouch, str] | None:
        """The entry that names the object ``key`` and the key of the seal that holds it; None if none does.

        Where two seals name it, the one anchored nearest to it: its writer found
        more of the prefix stored, so wrote after the other (the object was put
        again, e.g. after a load removed it as damaged, with a seal of its own).
        """
        held = self._vouches.get(key_id(key))
        return None if held is None else (held[0], held[1])

    def witness(self, record: StoreObject) -> Witness:
        """What the seals read say of ``record`` (its stream and chunk index place it among their spans)."""
        found = self.vouch_for(record.key)
        if found is not None:
            return Witness(*found)
        suspects = self._unreadable.get(key_stem(record.key, record.chunk_hash), ())
        for anchor_index, seal, why in suspects:
            if anchor_index <= record.chunk_index < anchor_index + SEAL_SPAN:
                return Witness(None, seal, why)
        return Witness(None)
