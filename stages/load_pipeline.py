"""The load path's graph ready-wired: one ``load`` stage, batched.

Written, like the save graph, as the document a YAML file would hold and built
through the registry, so a user's copy behaves like the default. Lookups need no
graph: the scheduler asks them before blocks are allocated, in one store call per
scheduling step (:mod:`.lookup`); loads run on the worker once blocks are.
"""

from __future__ import annotations

import copy
from typing import Any

from kvpipe.pipeline import Graph, build_graph

from .batch_calls import MAX_BUFFERS_PER_CALL
from .integrity import Integrity
from .load import LayerObserver, LoadObserver
from .model import KVCache
from .registry import KV_STAGES
from .retention import LoadedKeys
from .store import LoadingStore

DEFAULT_LOAD_PIPELINE: dict[str, Any] = {
    "stages": [
        {
            "name": "load",
            "type": "load",
            "batch": {"max_items": 64, "max_wait_ms": 0},
            # a store call that hangs (a read from a node cut off by the network waits for the
            # kernel's connect) holds one worker; later loads go on in the other
            "workers": 2,
            "threads": 2,  # seals and layers are checked in both: the engine waits for the verdicts
            "params": {"max_buffers_per_call": MAX_BUFFERS_PER_CALL, "integrity": "verify"},
        },
    ]
}


def default_load_graph(
    kv: KVCache,
    store: LoadingStore,
    load_observer: LoadObserver | None = None,
    *,
    max_buffers_per_call: int = MAX_BUFFERS_PER_CALL,
    integrity: Integrity | str = Integrity.VERIFY,
    loaded_keys: LoadedKeys | None = None,
    layer_observer: LayerObserver | None = None,
) -> Graph:
    """The default load graph; ``load_observer`` is told each request's failed block ids.

    ``integrity`` is how loads check seals (:class:`~.integrity.Integrity`);
    ``loaded_keys`` is told every object loaded (the save graph's retention counts them);
    ``layer_observer``, each wave of a layered load as it lands (:mod:`.layers`).
    """
    document = copy.deepcopy(DEFAULT_LOAD_PIPELINE)
    document["stages"][0]["params"]["max_buffers_per_call"] = max_buffers_per_call
    document["stages"][0]["params"]["integrity"] = Integrity(integrity).value
    resources = {
        "kv": kv,
        "store": store,
        "load_observer": load_observer,
        "loaded_keys": loaded_keys,
        "layer_observer": layer_observer,
    }
    return build_graph(document, KV_STAGES, resources)
