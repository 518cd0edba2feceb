"""The chunks this engine is saving right now: what a lookup may wait for instead of computing again.

A save lands a few milliseconds to a second after its step (the save pipeline
runs beside the engine, nicer than it). A request that asks for a prefix the
engine itself computed a moment ago, and no longer holds in its own cache (vLLM's
prefix cache was reset, the blocks were evicted, the request was preempted), would
find the store without it and compute it again, although its objects are on
their way. The scheduler remembers each chunk it plans for saving until every rank
that puts has reported on it (the workers' chunk reports, :mod:`.events`) or its
wait is over, so a lookup whose hit such a chunk would extend asks vLLM to ask
again next step (``None``) instead of answering a miss.

Why a bound: a report may never come (a save past its deadline reports nothing
when its job cannot end, a worker may die), and a request must not wait on it
forever; the bound is the save-to-visible latency a busy engine meets (about a
second at p99, ``kvpipe bench save-visible``). A report of a chunk not stored ends
the wait at once: waiting longer cannot make it appear.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .messages import ChunkReport, Rank, chunk_settled

#: chunks remembered at most; the oldest are forgotten first (a lookup then misses them, as without waiting)
LIMIT = 4096


@dataclass
class _Saving:
    until: float  # when a lookup stops waiting for it
    reported: set[Rank] = field(default_factory=set)  # ranks that stored it


class SavesInFlight:
    """Chunk hashes (hex, as keys end) planned for saving and not yet stored by every rank, each for a bounded time."""

    def __init__(
        self, ranks: Iterable[Rank], wait_s: float, clock: Callable[[], float], limit: int = LIMIT
    ) -> None:
        self._ranks = frozenset(ranks)
        self._wait_s = wait_s
        self._clock = clock
        self._limit = limit
        # in planning order, so in order of their ends: the expired ones are at the front
        self._saving: OrderedDict[str, _Saving] = OrderedDict()

    def planned(self, chunk_hashes: Iterable[bytes]) -> None:
        """The chunks of a save the scheduler has just planned (a chunk already awaited keeps its first end)."""
        now = self._clock()
        while self._saving and next(iter(self._saving.values())).until <= now:
            self._saving.popitem(last=False)  # over: planned first, so they end first
        until = now + self._wait_s
        for chunk_hash in chunk_hashes:
            hex_hash = chunk_hash.hex()
            if hex_hash not in self._saving:
                self._saving[hex_hash] = _Saving(until)
        while len(self._saving) > self._limit:
            self._saving.popitem(last=False)

    def reported(self, reports: Iterable[ChunkReport]) -> None:
        """The workers' word on chunks they saved: stored by every rank, or not stored by one, ends the wait."""
        for report in reports:
            hex_hash = report[2].hex()
            saving = self._saving.get(hex_hash)
            if saving is not None and chunk_settled(saving.reported, report, self._ranks) is not None:
                del self._saving[hex_hash]

    def awaited_among(self, hex_hashes: Iterable[str]) -> set[str]:
        """Those of ``hex_hashes`` a lookup may still wait for: planned, unreported, within their wait."""
        now = self._clock()
        saving = self._saving
        return {hex_hash for hex_hash in hex_hashes if (entry := saving.get(hex_hash)) and entry.until > now}

    def forget(self) -> None:
        """A reset removed what the saves store: nothing in flight is worth waiting for."""
        self._saving.clear()
