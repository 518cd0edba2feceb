"""Which store nodes are alive, as a client can tell between the master's heartbeats.

A store node that dies takes its segment's objects with it, but the master learns
so only when the node's heartbeats stop for its client TTL (``--client_ttl``, 10 s
by default). Until then ``batch_is_exist`` still answers 1 for every object on the
lost node and each read of one fails (-800): a lookup would count chunks that can
no longer load as hits.

:class:`SegmentLiveness` closes that window from the client's side. An object's
replicas name the transfer endpoint (``host:port``) of the segment that holds
them; a node that is gone refuses a connection there (or, a machine that is gone,
lets it time out). Each endpoint is probed at most once per ``ttl_s`` and the answer
cached, so a lookup costs one more master RPC (the replica descriptors) and, once
a second, one connect per node it touches.

:meth:`SegmentLiveness.lost_keys` applies it to objects: a read may go to any of an
object's replicas, so an object is readable only when every replica it may be read
from is on a node that answers.

The probe is a TCP connect, which every transport's endpoint accepts on the
machines this is tested on (``tcp``); ``verify_replicas: false`` turns it off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .master import is_listening
from .master_address import split_host_port


class SegmentLiveness:
    """Cached answers to "does this transfer endpoint accept a connection?"."""

    def __init__(
        self,
        *,
        probe_timeout_s: float = 0.2,
        ttl_s: float = 1.0,
        probe: Callable[[str, int, float], bool] = is_listening,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe_timeout_s = probe_timeout_s
        self._ttl_s = ttl_s
        self._probe = probe
        self._clock = clock
        self._lock = threading.Lock()
        self._known: dict[str, tuple[bool, float]] = {}  # endpoint -> (alive, when probed)

    def alive(self, endpoint: str) -> bool:
        """Whether ``endpoint`` accepted a connection within the last ``ttl_s`` (probing it if needed).

        An endpoint that is no ``host:port`` cannot be probed and counts as alive:
        liveness only ever takes away hits it can prove lost.
        """
        now = self._clock()
        with self._lock:
            known = self._known.get(endpoint)
        if known is not None and now - known[1] < self._ttl_s:
            return known[0]
        try:
            host, port = split_host_port(endpoint)
        except ValueError:
            return True
        alive = self._probe(host, port, self._probe_timeout_s)
        with self._lock:
            self._known[endpoint] = (alive, now)
        return alive

    def lost_keys(
        self, keys: Iterable[str], replicas: Mapping[str, Sequence[Any]], complete: object
    ) -> set[str]:
        """Those of ``keys`` with a replica in state ``complete`` on a node that does not answer.

        ``replicas`` are the client's descriptors by key (``batch_get_replica_desc``); a key
        without any counts as readable. Each endpoint is asked once per call: most keys
        share their nodes.
        """
        alive: dict[str, bool] = {}
        lost: set[str] = set()
        for key in keys:
            for replica in replicas.get(key, ()):
                # the state compared as the enum it is: its ``str`` costs ~3.6 us, most of a
                # lookup's verification once (800 stored keys: its Python 5.0 -> ~2 ms); and
                # no generator per key: this runs on the engine's thread at every lookup
                if replica.status != complete or not replica.is_memory_replica():
                    continue  # a disk replica is not probed: it counts as alive
                endpoint = replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
                answer = alive.get(endpoint)
                if answer is None:
                    answer = alive[endpoint] = self.alive(endpoint)
                if not answer:
                    lost.add(key)
                    break
        return lost
