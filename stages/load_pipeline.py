"""The load path's graphs ready-wired: lookup -> lookup_results, and load.

Written, like the save graph, as the documents a YAML file would hold and built
through the registry, so a user's copy behaves like the default. The two are
separate graphs because the engine asks them at different times and sides:
lookups come from the scheduler before blocks are allocated, loads from the
worker once they are.

The lookup graph ends in ``lookup_results`` because a graph needs every port
read and ``lookup`` keeps its ``out`` port; each job's counts carry its answer
(``hit_tokens``, ``hit_chunks``) and ``lookup_observer`` gets each result.
"""

from __future__ import annotations

import copy
from typing import Any

from kvpipe.pipeline import Graph, build_graph

from .load import LoadObserver
from .lookup import LookupObserver
from .model import KVCache
from .put import MAX_BUFFERS_PER_CALL
from .registry import KV_STAGES
from .store import LoadingStore

DEFAULT_LOOKUP_PIPELINE: dict[str, Any] = {
    "stages": [
        {"name": "lookup", "type": "lookup", "batch": {"max_items": 256, "max_wait_ms": 0}},
        {"name": "lookup_results", "type": "lookup_results", "after": "lookup"},
    ]
}

DEFAULT_LOAD_PIPELINE: dict[str, Any] = {
    "stages": [
        {
            "name": "load",
            "type": "load",
            "batch": {"max_items": 64, "max_wait_ms": 0},
            "params": {"max_buffers_per_call": MAX_BUFFERS_PER_CALL},
        },
    ]
}


def default_lookup_graph(
    kv: KVCache, store: LoadingStore, lookup_observer: LookupObserver | None = None
) -> Graph:
    """The default lookup graph over ``kv`` and ``store``; ``lookup_observer`` sees every result."""
    return build_graph(
        copy.deepcopy(DEFAULT_LOOKUP_PIPELINE),
        KV_STAGES,
        {"kv": kv, "store": store, "lookup_observer": lookup_observer},
    )


def default_load_graph(
    kv: KVCache,
    store: LoadingStore,
    load_observer: LoadObserver | None = None,
    *,
    max_buffers_per_call: int = MAX_BUFFERS_PER_CALL,
) -> Graph:
    """The default load graph; ``load_observer`` is told each request's failed block ids."""
    document = copy.deepcopy(DEFAULT_LOAD_PIPELINE)
    document["stages"][0]["params"]["max_buffers_per_call"] = max_buffers_per_call
    return build_graph(document, KV_STAGES, {"kv": kv, "store": store, "load_observer": load_observer})
