"""Which store nodes are alive, as a client can tell between the master's heartbeats.

A store node that dies takes its segment's objects with it, but the master learns
so only when the node's heartbeats stop for its client TTL (``--client_ttl``, 10 s
by default). Until then ``batch_is_exist`` still answers 1 for every object on the
lost node and each read of one fails (-800): a lookup would count chunks that can
no longer load as hits.

:class:`SegmentLiveness` closes that window from the client's side. An object's
replicas name the transfer endpoint (``host:port``) of the segment that holds
them (remembered per key: :mod:`.replica_places`); a node that is gone refuses a
connection there (or, a machine that is gone, lets it time out). Each endpoint is
probed at most once per ``ttl_s`` and the answer cached, so a lookup costs one
more master RPC, and only for keys whose places it does not know. Only an
endpoint never seen is probed on the caller's thread; an answer past its ``ttl_s``
is given as it stands while a probe in a thread of its own renews it. A lookup runs
on the engine's thread at every step: renewing in place would hold it for a connect
per node each second, and for the whole probe timeout (0.2 s) each second while a
node is cut off by the network.

:meth:`SegmentLiveness.lost_keys` applies it to objects: a read may go to any of an
object's replicas, so an object is readable only when every replica it may be read
from is on a node that answers.

The probe is a TCP connect, which every transport's endpoint accepts on the
machines this is tested on (``tcp``); ``verify_replicas: false`` turns it off.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from .listening import is_listening
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
        renew: Callable[[Callable[[], object]], None] | None = None,
    ) -> None:
        """``renew``: hands over a probe that renews an expired answer (default: to a thread of this object's)."""
        self._probe_timeout_s = probe_timeout_s
        self._ttl_s = ttl_s
        self._probe = probe
        self._clock = clock
        own = _Renewer()  # no thread until it renews an answer
        self._renewer = own if renew is None else None
        self._renew = renew if renew is not None else own
        self._lock = threading.Lock()
        self._known: dict[str, tuple[bool, float]] = {}  # endpoint -> (alive, when probed)
        # endpoint -> when a probe set out to renew its expired answer; one that has not answered
        # in a few probe timeouts is taken as lost (its process forked while it ran) and sent again
        self._renewing: dict[str, float] = {}
        self._renewal_lost_s = max(1.0, 5 * probe_timeout_s)

    def alive(self, endpoint: str) -> bool:
        """Whether ``endpoint`` accepted a connection when last probed.

        An endpoint never probed is probed now; an answer older than ``ttl_s`` is
        given as it stands while another thread probes again (one probe at a time
        per endpoint). An endpoint that is no ``host:port`` cannot be probed and
        counts as alive: liveness only ever takes away hits it can prove lost.
        """
        now = self._clock()
        with self._lock:
            known = self._known.get(endpoint)
            renew = (
                known is not None
                and now - known[1] >= self._ttl_s
                and now - self._renewing.get(endpoint, -math.inf) >= self._renewal_lost_s
            )
            if renew:
                self._renewing[endpoint] = now
        if known is not None:
            if renew:
                self._renew(functools.partial(self._probe_now, endpoint))
            return known[0]
        return self._probe_now(endpoint)

    def close(self) -> None:
        """End the thread that renews answers (idempotent; an answer asked for later starts it again)."""
        if self._renewer is not None:
            self._renewer.close()

    def _probe_now(self, endpoint: str) -> bool:
        """Probe ``endpoint`` on this thread and keep the answer (alive where it cannot be probed)."""
        now = self._clock()
        try:
            host, port = split_host_port(endpoint)
        except ValueError:
            return True
        try:
            alive = self._probe(host, port, self._probe_timeout_s)
        finally:
            with self._lock:
                self._renewing.pop(endpoint, None)
        with self._lock:
            self._known[endpoint] = (alive, now)
        return alive

    def lost_keys(self, keys: Iterable[str], endpoints_of: Callable[[str], Sequence[str]]) -> set[str]:
        """Those of ``keys`` with a replica on a node that does not answer.

        ``endpoints_of(key)``: where the key's replicas that a read may go to lie
        (:class:`~.replica_places.ReplicaPlaces`); a key with none counts as readable.
        Each endpoint is asked once per call: most keys share their nodes.
        """
        alive: dict[str, bool] = {}
        lost: set[str] = set()
        for key in keys:
            for endpoint in endpoints_of(key):
                answer = alive.get(endpoint)
                if answer is None:
                    answer = alive[endpoint] = self.alive(endpoint)
                if not answer:
                    lost.add(key)
                    break
        return lost


class _Renewer:
    """One daemon thread that runs the renewing probes, in turn: handing one over costs the caller ~1 us.

    (A thread started per probe cost its caller ~0.3 ms, more than the local connect it spares.)
    """

    def __init__(self) -> None:
        self._probes: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __call__(self, probe: Callable[[], object]) -> None:
        if self._thread is None or not self._thread.is_alive():  # first use, or a forked process
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._probes = queue.SimpleQueue()
                    self._thread = threading.Thread(
                        target=self._run, args=(self._probes,), name="kvpipe-liveness", daemon=True
                    )
                    self._thread.start()
        self._probes.put(probe)

    def close(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._probes.put(None)  # the thread ends once the probes before it have run
            self._thread = None

    @staticmethod
    def _run(probes: queue.SimpleQueue[Callable[[], object] | None]) -> None:
        while (probe := probes.get()) is not None:
            probe()
