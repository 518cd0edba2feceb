"""Another engine's lookup, in a process of its own: when does each watched key become visible?

    python -m kvpipe.connector.bench.visibility_probe MASTER METADATA

A pure store client (no segment) that reads watch orders on stdin, one JSON line
each, ``[computed_at, [key, ...]]`` (``computed_at`` on ``time.monotonic()``,
which on Linux is one clock for every process of the machine), and asks the
master every :data:`POLL_S` whether the keys it still waits for exist, as a
scheduler's lookup does. When stdin closes it keeps asking until every key was
seen or :data:`LINGER_S` has passed, then prints one JSON line: per key seen, the
seconds from ``computed_at`` to the first answer that found it; and the keys
never seen.

It runs apart from the engine it watches so its polling takes nothing from that
engine's interpreter, and so what it measures is what any other engine would see.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore

from .peer import READY, start_ready_child

POLL_S = 0.002
#: how long keys still unseen are waited for once the watcher has no more to send
LINGER_S = 15.0


def _read_orders(orders: queue.SimpleQueue[tuple[float, list[str]] | None]) -> None:
    for line in sys.stdin:
        computed_at, keys = json.loads(line)
        orders.put((computed_at, keys))
    orders.put(None)


def main() -> None:
    master, metadata = sys.argv[1], sys.argv[2]
    settings = MooncakeSettings(master=master, metadata_server=metadata, global_segment_size=0, local_buffer_size=0)
    orders: queue.SimpleQueue[tuple[float, list[str]] | None] = queue.SimpleQueue()
    waiting: dict[str, float] = {}  # key -> computed_at
    seen: dict[str, float] = {}  # key -> seconds to visible
    with MooncakeStore.open(settings) as store:
        print(READY, flush=True)
        threading.Thread(target=_read_orders, args=(orders,), daemon=True).start()
        closed_at: float | None = None
        while closed_at is None or (waiting and time.monotonic() - closed_at < LINGER_S):
            while not orders.empty():
                order = orders.get()
                if order is None:
                    closed_at = time.monotonic()
                else:
                    waiting.update(dict.fromkeys(order[1], order[0]))
            if waiting:
                keys = list(waiting)
                answers = store.batch_is_exist(keys)
                now = time.monotonic()
                for key, answer in zip(keys, answers, strict=True):
                    if answer == 1:
                        seen[key] = now - waiting.pop(key)
            time.sleep(POLL_S)
    print(json.dumps({"seen": seen, "unseen": sorted(waiting)}), flush=True)


@dataclass(frozen=True)
class Visibility:
    """What the probe saw: seconds from computed to visible per key seen, and the keys never seen."""

    seen: dict[str, float]
    unseen: list[str]


class Probe:
    """The parent's handle on a running probe: :meth:`watch` keys, then :meth:`finish` for what it saw."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._process = process

    def watch(self, computed_at: float, keys: list[str]) -> None:
        """Wait for ``keys``, computed at ``computed_at`` (``time.monotonic()``), to become visible."""
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps([computed_at, keys]) + "\n")
        self._process.stdin.flush()

    def finish(self) -> Visibility:
        """Send no more; wait (up to :data:`LINGER_S` and a margin) for the probe's answer.

        Raises RuntimeError if the probe exits without one.
        """
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.close()
        line = self._process.stdout.readline()
        self._process.wait(timeout=LINGER_S + 15)
        if not line:
            raise RuntimeError(f"the visibility probe ended without an answer (exit code {self._process.returncode})")
        answer = json.loads(line)
        return Visibility(answer["seen"], answer["unseen"])


@contextmanager
def visibility_probe(master: str, metadata: str) -> Iterator[Probe]:
    """Run a probe on ``master`` for the block; it is stopped on the way out, whatever happened.

    :raises RuntimeError: its store client did not start.
    """
    process = start_ready_child(__name__, master, metadata, what="the visibility probe's store client")
    try:
        yield Probe(process)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


if __name__ == "__main__":
    main()
