"""Retention: keep the chunks that requests keep asking for.

A store smaller than its working set keeps what its eviction order spares.
Mooncake evicts the objects whose last read is oldest (a put counts as a read),
so a flood of one-off prompts (documents asked once, each request's own
suffix) pushes out the shared prefixes that every other request would hit.
Mooncake's *soft pin* is the means against it: a soft-pinned object is evicted
only when no unpinned object is left to evict, and its pin lapses after a TTL
(reads do not renew it). No read grants a pin and no call pins an object
already stored without rewriting it, so the pin is given at the put.

Which chunks earn one is decided where every request is seen, and where the
bytes are known:

- :class:`ReuseCounter` (the scheduler side, which looks up every request):
  how many requests asked for each chunk lately. A chunk asked for by
  ``min_requests`` requests (a prefix that came back after it was evicted, or
  that two requests share) goes in its :class:`~.model.SaveRequest`'s
  ``reused_chunks`` with its count. A chunk seen once does not: the first
  request of a shared prefix and a one-off document look alike, and pinning
  both would pin the flood too.
- :class:`PinBudget` (the put stage, which knows each object's bytes): a bound
  on the bytes this writer holds pinned at once, counted until each pin's TTL
  lapses, so pins never fill the store however the counts go. Past the bound,
  a chunk asked for by more requests than some held pin's demotes it (its
  object is removed: no call takes a pin back) so that the budget holds the
  most requested chunks, as a static choice of the hottest prefixes would;
  otherwise the object is put unpinned.

- :class:`LoadedKeys` (from the load stage to the put stage's budget): the keys
  loaded from the store since the budget last looked. Each load of a pinned
  object is one more request that asked for its chunk, so its pin's count grows
  with every hit, not only with the requests counted before its put: a hot chunk
  pinned early, at two requests, is not demoted by a newcomer with three.

A pin is soft only: a master that allows evicting soft-pinned objects (the
default) still evicts them, oldest read first, once nothing else is left.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

#: the share of the store's memory the writers' pins may hold together by default (each
#: writer's budget is its part of it): Mooncake's default high watermark, what a store
#: keeps before it evicts
PINNED_SHARE = 0.9

#: chunk hashes a counter remembers (16-byte hashes: ~20 MiB at this size)
DEFAULT_REMEMBERED_CHUNKS = 1 << 18
#: loaded keys held for the put stage between two of its pin decisions (object keys of
#: ~80-120 characters: ~10 MiB at this size, where the chunk bound above would hold ~40 MiB)
DEFAULT_REMEMBERED_LOADS = 1 << 16

#: reads the store's capacity in object bytes, None where it cannot be known (asked once, at start)
CapacityReader = Callable[[], int | None]


class PinnedBudget(NamedTuple):
    """One writer's pin budget and where it came from: what a worker logs at start."""

    pinned_bytes: int
    #: ``retention off``, ``retention_max_pinned``, ``store capacity``, ``lent`` or ``lent, capacity unknown``
    source: str
    #: the store's capacity it was sized from (None: not read, or unknown)
    store_capacity: int | None = None
    #: the writers it is shared among (engines x each engine's ranks that put; 1 for the rules not shared)
    writers: int = 1


class ReuseCounter:
    """Requests per chunk hash, for the most recently asked ``remembered`` chunks.

    Forgetting the least recently asked keeps memory bounded on an endless
    stream of one-off prompts; a prefix asked for often is always recent.
    """

    def __init__(self, min_requests: int = 2, remembered: int = DEFAULT_REMEMBERED_CHUNKS) -> None:
        """:raises ValueError: ``min_requests`` or ``remembered`` is below 1."""
        if min_requests < 1:
            raise ValueError(f"ReuseCounter: min_requests must be >= 1, got {min_requests}")
        if remembered < 1:
            raise ValueError(f"ReuseCounter: remembered must be >= 1, got {remembered}")
        self.min_requests = min_requests
        self._remembered = remembered
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def asked(self, chunk_hashes: Iterable[bytes]) -> None:
        """One request's prompt asked for these chunks (call once per request, not per lookup)."""
        counts = self._counts
        for chunk_hash in dict.fromkeys(chunk_hashes):
            counts[chunk_hash] = counts.pop(chunk_hash, 0) + 1
        while len(counts) > self._remembered:
            counts.popitem(last=False)

    def requests(self, chunk_hash: bytes) -> int:
        """How many requests asked for ``chunk_hash`` (0 if forgotten or never)."""
        return self._counts.get(chunk_hash, 0)

    def reused(self, chunk_hashes: Iterable[bytes]) -> dict[bytes, int]:
        """Those of ``chunk_hashes`` asked for by at least ``min_requests`` requests, with their counts."""
        counts = self._counts
        least = self.min_requests
        return {h: n for h in chunk_hashes if (n := counts.get(h, 0)) >= least}


class LoadedKeys:
    """Object keys loaded from the store, from the load stage's thread to the put stage's.

    ``deque`` appends and pops are atomic, so the two pipelines' threads share it
    without a lock. Bounded: keys nobody took (a put stage that saw no reused
    chunk for a while) are dropped oldest first, which only leaves counts lower.
    """

    def __init__(self, remembered: int = DEFAULT_REMEMBERED_LOADS) -> None:
        self._keys: deque[str] = deque(maxlen=remembered)

    def loaded(self, keys: Iterable[str]) -> None:
        """These objects were just loaded whole (one more request used each)."""
        self._keys.extend(keys)

    def take(self) -> list[str]:
        """The keys loaded since the last call, oldest first."""
        keys = self._keys
        taken = []
        while keys:
            taken.append(keys.popleft())
        return taken


@dataclass(slots=True)
class _Pin:
    size: int
    until: float  # when its TTL lapses
    reuse: int  # requests that asked for its chunk: those counted at its put, then one per load


class PinBudget:
    """The objects one writer holds soft-pinned, by key, each counted until its TTL lapses.

    A pin that would pass ``max_bytes`` is taken only if held pins asked for by
    fewer requests can make room: those are *demoted* (the caller removes them
    from the store, the only way to take a pin back), so the budget converges on
    the most requested chunks whatever order they arrived in, not on the first
    that happened to be asked twice. Not thread-safe: one put stage owns it, on
    its event loop.
    """

    def __init__(
        self,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        loads: LoadedKeys | None = None,
    ) -> None:
        """``loads``: the keys loaded since, each one more request for a held pin's chunk.

        :raises ValueError: ``max_bytes`` < 0 or ``ttl_s`` <= 0.
        """
        if max_bytes < 0:
            raise ValueError(f"PinBudget: max_bytes must be >= 0, got {max_bytes}")
        if ttl_s <= 0:
            raise ValueError(f"PinBudget: ttl_s must be > 0, got {ttl_s}")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._loads = loads
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # by key, the first to lapse first
        self._least_reused: list[tuple[int, float, str]] = []  # heap; an entry stale once its pin changed
        self._held = 0

    @property
    def ttl_ms(self) -> int:
        return round(self.ttl_s * 1000)

    @property
    def held_bytes(self) -> int:
        """Bytes pinned whose pin has not lapsed yet."""
        self._lapse(self._clock())
        return self._held

    def admit(self, key: str, size: int, reuse: int) -> tuple[bool, list[str]]:
        """Whether to pin ``key`` (``size`` bytes, its chunk asked for by ``reuse`` requests) now.

        Returns the decision and the keys of held pins demoted to make room (all
        asked for by fewer requests): the caller removes them from the store. A
        key pinned again (its object was evicted and is put anew) replaces its
        earlier pin.
        """
        now = self._clock()
        self._lapse(now)
        self._count_loads()
        self.release(key)
        demoted = self._make_room(size, reuse)
        if demoted is None:
            return False, []
        for victim in demoted:
            self.release(victim)
        pin = _Pin(size, now + self.ttl_s, reuse)
        self._pins[key] = pin
        self._held += size
        heapq.heappush(self._least_reused, (reuse, pin.until, key))
        return True, demoted

    def _make_room(self, size: int, reuse: int) -> list[str] | None:
        """The least requested held pins whose demotion fits ``size`` (none if it fits), or None if none can."""
        short = self._held + size - self.max_bytes
        if short <= 0:
            return []
        if size > self.max_bytes:
            return None
        victims: list[str] = []
        heap = self._least_reused
        seen: list[tuple[int, float, str]] = []
        while short > 0 and heap:
            entry = heapq.heappop(heap)
            seen.append(entry)
            fewer, until, key = entry
            pin = self._pins.get(key)
            if pin is None or (pin.until, pin.reuse) != (until, fewer) or key in victims:
                seen.pop()  # stale: that pin lapsed or was replaced
                continue
            if fewer >= reuse:
                break  # every pin left was asked for as often or more
            victims.append(key)
            short -= pin.size
        if short > 0:  # not enough: keep them all
            for entry in seen:
                heapq.heappush(heap, entry)
            return None
        return victims

    def _count_loads(self) -> None:
        """Each load of a held pin's object since the last admit is one more request for its chunk."""
        if self._loads is None:
            return
        for key in self._loads.take():
            pin = self._pins.get(key)
            if pin is not None:
                pin.reuse += 1  # its heap entries go stale; the fresh one replaces them
                heapq.heappush(self._least_reused, (pin.reuse, pin.until, key))

    def release(self, key: str) -> None:
        """``key`` holds no pin (its pinned put failed, or it was demoted): its bytes are free again."""
        pin = self._pins.pop(key, None)
        if pin is not None:
            self._held -= pin.size

    def _lapse(self, now: float) -> None:
        pins = self._pins
        while pins:
            key, pin = next(iter(pins.items()))
            if pin.until > now:
                break
            del pins[key]
            self._held -= pin.size
        if len(self._least_reused) > 2 * len(pins) + 64:  # drop the stale entries now and then
            self._least_reused = [(p.reuse, p.until, k) for k, p in pins.items()]
            heapq.heapify(self._least_reused)
