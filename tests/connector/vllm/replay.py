"""Reading vLLM's KV events back from its publisher's replay endpoint (a ROUTER socket it binds).

Replay instead of a live SUB socket: a subscriber misses what is published before
its subscription reaches the publisher, and no wait makes that certain; the replay
buffer holds every batch since the start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import MEDIUM_CPU, KVEventBatch

END = (-1).to_bytes(8, "big", signed=True)


class Replayer:
    """Every event published since the last call, in order. Close it (or use it as a context manager)."""

    def __init__(self, endpoint: str, answer_timeout_s: float = 10.0) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._next = 0
        self._answer_timeout_ms = int(answer_timeout_s * 1000)

    def __enter__(self) -> Replayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def replay(self) -> list[Any]:
        """The events of the batches published since the last call (raises if the publisher is silent)."""
        self._socket.send_multipart([b"", self._next.to_bytes(8, "big")])
        found: list[Any] = []
        while True:
            if not self._socket.poll(self._answer_timeout_ms):
                raise TimeoutError("the KV-event publisher did not answer a replay request")
            _, _, seq, payload = self._socket.recv_multipart()
            if seq == END:
                return found
            self._next = int.from_bytes(seq, "big") + 1
            found.extend(self._decoder.decode(payload).events)

    def until(self, enough: Callable[[list[Any]], bool], timeout_s: float = 30.0) -> list[Any]:
        """Replay until ``enough`` holds for the events found (or the deadline: then what was found)."""
        deadline = time.monotonic() + timeout_s
        found = self.replay()
        while not enough(found) and time.monotonic() < deadline:
            time.sleep(0.2)
            found.extend(self.replay())
        return found

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def kvpipe_events(events: list[Any], kind: type) -> list[Any]:
    """The events of ``kind`` kvpipe published (medium CPU), not the engine's own (GPU)."""
    return [e for e in events if isinstance(e, kind) and e.medium == MEDIUM_CPU]
