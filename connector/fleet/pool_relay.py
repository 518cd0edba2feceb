"""The shared pool's KV events, relayed to every worker's router stream.

vLLM's router (``kv_aware``) files a ``BlockStored`` whose ``ownership`` names a
shared pool at its external tier, and credits the block to the worker whose event
stream carried it; it refuses to take one stream under two workers ("live KV
streams must be independent"). kvpipe's events name the deployment's pool, and a
chunk one replica stored is reachable through every replica: each worker's
streams must carry it, not the writer's alone.

:class:`PoolRelay` subscribes to every replica's vLLM event stream, keeps the
events that name a pool (kvpipe's; the engine's own blocks name none), and
republishes them, with vLLM's publisher and wire format, on one stream per worker,
which the router takes beside that worker's own stream. A replica's own chunks
reach it twice (its stream and its relay stream): the router's claims are
idempotent per owner, tier and block. Events published before the relay joined a
stream are not relayed (a router misses them either way).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

TOPIC = "kv"
POLL_MS = 100


class PoolRelay:
    """One thread: a SUB on every replica's stream in, one publisher per worker out. Use as a context manager."""

    def __init__(self, sources: Sequence[str], outputs: Sequence[str]) -> None:
        """``sources``: the replicas' event endpoints (to connect); ``outputs``: one bind endpoint per worker."""
        self.sources = list(sources)
        self.outputs = list(outputs)
        self.relayed = 0  # events republished (per worker stream once)
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._publishers: list[ZmqEventPublisher] = []
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PoolRelay:
        self._publishers = [
            ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic=TOPIC)
            for endpoint in self.outputs
        ]
        subscriber = self._context.socket(zmq.SUB)
        for endpoint in self.sources:
            subscriber.connect(endpoint)
        subscriber.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._thread = threading.Thread(target=self._run, args=(subscriber,), name="pool-relay", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for publisher in self._publishers:
            publisher.shutdown()
        self._context.term()

    def _run(self, subscriber: zmq.Socket[bytes]) -> None:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        try:
            while not self._stop.is_set():
                if not subscriber.poll(POLL_MS):
                    continue
                frames = subscriber.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    batch = decoder.decode(frames[2])
                except msgspec.DecodeError:
                    continue
                pooled = [event for event in batch.events if getattr(event, "ownership", None)]
                if not pooled:
                    continue
                for publisher in self._publishers:
                    publisher.publish(KVEventBatch(ts=batch.ts, events=pooled, data_parallel_rank=0))
                self.relayed += len(pooled)
        finally:
            subscriber.close(linger=0)
