"""A writer that dies midway through a layer-wise save: run as ``python -m tests.connector.store.killed_writer``.

It saves one request of a small cache into the master whose address and metadata
server it is given, layer by layer through the real save stages; once the first
layer is written it prints the request's keys (one line of JSON) and waits for a
second layer that never comes, to be killed there.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import replace

import anyio

from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.connector.store.mooncake.settings import MooncakeSettings
from kvpipe.stages import object_key

from ...stages.kv_fixtures import FULL, make_kv, make_request
from ...stages.save_path import run_save_path

LAYERS = 3


class FirstLayerOnly:
    """A step whose first layer is computed and whose second never is (:class:`~kvpipe.stages.model.LayerProgress`)."""

    def __init__(self, waves: tuple[tuple[tuple[int, int], ...], ...], keys: list[str]) -> None:
        self.waves = waves
        self._keys = keys

    def wait(self, step: int, timeout_s: float) -> bool:
        if step == 0:
            return True
        print(json.dumps(self._keys), flush=True)  # the first layer is written: kill me now
        threading.Event().wait()
        return False


def main(master: str, metadata_server: str) -> None:
    store = MooncakeStore.open(MooncakeSettings(master=master, metadata_server=metadata_server, global_segment_size=0))
    source = make_kv((FULL,), shards=1, layers=LAYERS, seed=0)
    request = make_request(source.kv, 32)
    region = source.kv.shards[0].layouts[0].regions[0].bytes_per_block
    waves = tuple(((layer * region, region),) for layer in range(LAYERS))
    keys = [object_key(source.kv.shards[0].namespace, 0, chunk_hash) for chunk_hash in request.block_hashes]
    anyio.run(run_save_path, source.kv, store, [replace(request, layers=FirstLayerOnly(waves, keys))])


if __name__ == "__main__":
    main(*sys.argv[1:3])
