"""Where each stored object's replicas lie, remembered so that a lookup need not ask every time.

A verified lookup (:mod:`.segment_liveness`) needs the transfer endpoint of every
replica of every object the master says exists: one more master RPC
(``batch_get_replica_desc``) and ~3 us of Python per key reading the native
descriptors. That was six times the lookup itself (256 stored keys: 2.8-3.1 ms
against 0.46-0.49 ms unverified, 1.9-2.1 ms of it the caller's CPU), at every
scheduling step: the scheduler asks about the waiting requests' chunks at each
step, the same keys again and again (remembered: 0.63 ms, 0.26 ms of CPU).

An object stays where it was put until it is removed, so the endpoints are
remembered per key and only keys not placed lately are asked about. Two things
move an object: removed (evicted) and put again, perhaps on another node; moved
between tiers (offloaded to disk, promoted back to memory elsewhere). A place
learned before such a move is trusted for ``max_age_s`` at most: until then a
lookup may count an object whose new replica lies on a node lost since (its load
fails, and the engine computes the chunk instead, as for any stale hit), or miss
one whose old place was lost. (Forgetting the keys a lookup finds absent would
catch some moves sooner, at a pass over every lookup's keys, most of them never
placed: 75-100 ns a key, measured, for little: while a lost node's objects are
still listed a key cannot be put again.)

``max_age_s`` (10 s) is the master's default client TTL: the time for which a
dead node's objects are still listed, i.e. the window the verification exists for.
At most ``max_keys`` are kept, the longest known dropped first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

#: how long a key's replica endpoints are trusted once learned (the master's default client TTL)
PLACES_MAX_AGE_S = 10.0
#: keys remembered at most (~10 MiB with their keys, measured; a scheduling step asks about up to 4,096)
PLACES_MAX_KEYS = 32_768

NOWHERE: tuple[str, ...] = ()


class ReplicaPlaces:
    """Per key, the transfer endpoints of its complete in-memory replicas, as last learned.

    Safe to use from several threads: readers take no lock, writers one.
    """

    def __init__(
        self,
        *,
        max_age_s: float = PLACES_MAX_AGE_S,
        max_keys: int = PLACES_MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_age_s = max_age_s
        self._max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (endpoints, when learned), the longest known first (dropped in O(1), unlike a dict's first key)
        self._places: OrderedDict[str, tuple[tuple[str, ...], float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._places)

    def unknown(self, keys: Iterable[str]) -> list[str]:
        """Those of ``keys`` whose places were never learned, dropped for room, or learned ``max_age_s`` ago."""
        oldest = self._clock() - self._max_age_s
        places = self._places
        return [key for key in keys if (known := places.get(key)) is None or known[1] <= oldest]

    def endpoints(self, key: str) -> tuple[str, ...]:
        """Where ``key``'s replicas that a read may go to lie (none known: readable, as a disk replica is)."""
        known = self._places.get(key)
        return NOWHERE if known is None else known[0]

    def learn(self, keys: Iterable[str], replicas: Mapping[str, Sequence[Any]], complete: object) -> None:
        """Remember the places of ``keys`` from the client's descriptors (``batch_get_replica_desc``).

        A replica counts when its state is ``complete`` and it lies in memory: a
        read may go to any such one. A key without descriptors has no place to
        check (it is readable as far as liveness can tell).
        """
        now = self._clock()
        learned = []
        for key in keys:
            endpoints = []
            for replica in replicas.get(key, ()):
                # the state compared as the enum it is: its ``str`` costs ~3.6 us a key
                if replica.status == complete and replica.is_memory_replica():
                    endpoints.append(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)
            learned.append((key, (tuple(endpoints), now)))
        with self._lock:
            places = self._places
            for key, place in learned:
                places[key] = place
                places.move_to_end(key)  # learned again: the newest, dropped last
            while len(places) > self._max_keys:
                places.popitem(last=False)
