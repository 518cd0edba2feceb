"""Which Mooncake client calls release the GIL, and what a busy Python thread costs them.

    python -m kvpipe.connector.bench.gil

Not a workload of the suite: a measurement behind docs/bench/log/design.md ("What
limits the rest"). A spinner thread counts Python loop iterations while this thread repeats
one store call. ``share`` is the spinner's progress during the calls over what it
makes alone in the same time: near 1 means the call released the GIL for its
whole native part. ``alone`` and ``beside`` are the call's duration without and
with the spinner: the difference is the wait to take the GIL back from a thread
that runs Python (up to ``sys.getswitchinterval()``, 5 ms, per native call).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, cast

from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster

from .kvbench import BenchCache, MiB, open_local_store
from .peer import remote_segment

REPEATS = 30


class Spinner:
    """A thread that counts loop iterations while ``active`` (and sleeps otherwise)."""

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        self._running = True
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while self._running:
            if self.active:
                self.count += 1
            else:
                time.sleep(0.001)

    def rate_alone(self, seconds: float = 0.3) -> float:
        """Iterations per second while this thread sleeps (the GIL is the spinner's)."""
        self.count, self.active = 0, True
        started = time.perf_counter()
        time.sleep(seconds)
        rate = self.count / (time.perf_counter() - started)
        self.active = False
        return rate

    def stop(self) -> None:
        self._running = False
        self._thread.join()


def measure(name: str, call: Callable[[], Any], spinner: Spinner, repeats: int = REPEATS) -> None:
    call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    alone = (time.perf_counter() - started) / repeats
    rate = spinner.rate_alone()
    spinner.count, spinner.active = 0, True
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    wall = time.perf_counter() - started
    spinner.active = False
    print(
        f"{name:52s} alone {alone * 1e6:7.0f} us  beside {wall / repeats * 1e6:7.0f} us  "
        f"share {spinner.count / (rate * wall):4.2f}",
        flush=True,
    )


def main() -> None:
    spinner = Spinner()
    cache = BenchCache.build(layers=4, buffer_bytes=4096, num_blocks=1100)
    records = [r for request in cache.requests([1] * 1024, salt="gil") for r in cache.records_of(request)]
    keys = [r.key for r in records]
    ptrs = [[b.address for b in r.buffers] for r in records]
    sizes = [[b.size for b in r.buffers] for r in records]
    try:
        with open_local_store(512 * MiB) as store, cache.registered(store):
            client = store._client  # the native calls themselves, without the wrapper's Python

            def put(n: int) -> list[int]:
                # the native client is untyped: it returns a code per key
                return cast(
                    "list[int]",
                    client.batch_put_from_multi_buffers(
                        keys[:n], ptrs[:n], sizes[:n], store.new_replicate_config()
                    ),
                )

            measure("batch_is_exist(96 absent keys)", lambda: client.batch_is_exist(keys[:96]), spinner)
            measure("batch_is_exist(1024 absent keys)", lambda: client.batch_is_exist(keys), spinner)
            put(48)
            measure("batch_put_from_multi_buffers(48 stored, own segment)", lambda: put(48), spinner)
            measure("batch_is_exist(48 stored)", lambda: client.batch_is_exist(keys[:48]), spinner)
            measure("batch_get_replica_desc(48)", lambda: client.batch_get_replica_desc(keys[:48]), spinner)
            measure("remove_all(force)", lambda: client.remove_all(True), spinner)
            measure(
                "remove_all + batch_put_from_multi_buffers(1024 x 4)",
                lambda: (client.remove_all(True), put(1024)),
                spinner,
                repeats=10,
            )
            put(48)
            measure(
                "store.batch_is_exist(96: 48 stored; two calls)",
                lambda: store.batch_is_exist(keys[:96]),
                spinner,
            )
        with LocalMaster() as master:
            assert master.endpoints is not None
            address, metadata = master.endpoints.master_address, master.endpoints.metadata_server
            settings = MooncakeSettings(
                master=address, metadata_server=metadata, global_segment_size=0, local_buffer_size=16 * MiB
            )
            with remote_segment(address, metadata, 256 * MiB), MooncakeStore.open(settings) as remote:
                rclient = remote._client
                object_bytes = cache.object_bytes
                base = cache.tensors[0].data_ptr()
                span = cache.tensors[0].nbytes
                if remote.register_buffer(base, span) != 0:
                    raise RuntimeError("could not register the source buffer")
                starts = [base + i * object_bytes for i in range(64) if (i + 1) * object_bytes <= span]

                def tcp_put() -> None:
                    rclient.remove_all(True)
                    rclient.batch_put_from(
                        keys[: len(starts)],
                        starts,
                        [object_bytes] * len(starts),
                        remote.new_replicate_config(),
                    )

                measure(
                    f"remove_all + batch_put_from({len(starts)} x {object_bytes // 1024} KiB, TCP)",
                    tcp_put,
                    spinner,
                    20,
                )
                remote.unregister_buffer(base)
    finally:
        spinner.stop()


if __name__ == "__main__":
    main()
