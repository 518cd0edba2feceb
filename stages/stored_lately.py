"""The keys a put stage stored lately: whose records the filter may have answered "absent" too early.

The filter asks the store about a batch's keys before the records reach the put
stage (through the gather stage and the put stage's queue), so another batch of
the same put stage may store one of those keys in between: two requests sharing
a prefix, saved in consecutive steps, each with chunks the other has not saved
yet. The put stage then holds a record whose key is stored already. Putting it
again harms no byte (a put of a stored key keeps the first value and answers 0),
but it harms the seals: the record may anchor a seal span
(:func:`~.integrity.seal_spans`) whose seal key is stored too, holding the first
writer's span. The second seal is then dropped as its object is (answered 0),
and the objects of its span the first seal does not name are stored with no
seal naming them (``kvpipe inspect --verify`` counted 33-161 of 2,163 objects of
``configs/mooncake.yaml`` so, a load finds them unverified).

So the put stage remembers for :data:`STORED_MEMORY_S` when it stored each key
(:class:`StoredLately`), and before a batch's put asks the store again about the
keys it stored after their records were made (:attr:`~.model.StoreObject.made_at`,
which is before the filter asked), and about the records made longer ago than it
remembers; a key the store holds is settled as existing, not put, so no span is
anchored at it. It asks once every other batch putting one of the batch's keys
is done (the put stage's claims, :mod:`.torn_chunks`), so within one put stage
the answer is exact; usually there is no such key, and no store call.
A writer in another process can still race it (docs/integrity.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .model import StoreObject

__all__ = ["STORED_MEMORY_S", "StoredLately"]

#: How long a stored key is remembered: far longer than a record spends between the
#: filter's answer and its put (the queues between them hold milliseconds of work);
#: a record older than this is asked about again whatever the memory says.
STORED_MEMORY_S = 5.0


class StoredLately:
    """When the put stage stored each key, for :data:`STORED_MEMORY_S` (used from its event loop only)."""

    __slots__ = ("_memory_s", "_clock", "_at")

    def __init__(self, memory_s: float = STORED_MEMORY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._memory_s = memory_s
        self._clock = clock
        self._at: dict[str, float] = {}  # key -> when it was last stored, oldest first

    def __len__(self) -> int:
        return len(self._at)

    def note(self, keys: Iterable[str]) -> None:
        """The put call that stored ``keys`` returned just now; keys stored longer ago than remembered go."""
        now = self._clock()
        at = self._at
        for key in keys:
            at.pop(key, None)  # to the end: the dict stays oldest first
            at[key] = now
        horizon = now - self._memory_s
        forgotten = []
        for key, when in at.items():
            if when >= horizon:
                break
            forgotten.append(key)
        for key in forgotten:
            del at[key]

    def stale(self, holders: Mapping[str, Sequence[tuple[Any, StoreObject]]]) -> list[str]:
        """The keys of ``holders`` (key -> its holders' records) the filter may have answered too early.

        A key this stage stored after the earliest of its records was made, or
        whose earliest record is older than the memory (it cannot say).
        """
        at = self._at
        horizon = self._clock() - self._memory_s
        stale = []
        for key, holding in holders.items():
            made = holding[0][1].made_at if len(holding) == 1 else min(held.made_at for _, held in holding)
            if made < horizon or ((stored := at.get(key)) is not None and stored >= made):
                stale.append(key)
        return stale
