"""The save pipeline ready-wired: project -> full | tail -> group_ids -> filter -> gather -> put.

The graph is written once, as the document a YAML file would hold
(``configs/save-pipeline.yaml`` is the same graph, kept equal by a test), and
built through the same registry and validation as any YAML pipeline, so the
default and a user's copy of it cannot behave differently.
"""

from __future__ import annotations

import copy
from typing import Any

from kvpipe.pipeline import Graph, build_graph

from .batch_calls import MAX_BUFFERS_PER_CALL
from .integrity import Integrity
from .model import KVCache
from .object_status import ObjectObserver
from .registry import KV_STAGES
from .retention import LoadedKeys
from .store import SavingStore
from .throttle import DEFAULT_THROTTLE, ThrottleParams

DEFAULT_SAVE_PIPELINE: dict[str, Any] = {
    "stages": [
        {"name": "project", "type": "project"},
        {"name": "full", "type": "full", "after": "project.full"},
        {"name": "tail", "type": "tail", "after": "project.tail"},
        {
            "name": "group_ids",
            "type": "group_ids",
            "after": ["full", "tail"],
            "params": {"enable_group_semantics": False},
        },
        {
            "name": "filter",
            "type": "filter",
            "after": "group_ids",
            "capacity": 1024,
            "batch": {"max_items": 256, "max_wait_ms": 1},
        },
        {
            "name": "gather",
            "type": "gather",
            "after": "filter",
            "batch": {"max_items": 64, "max_wait_ms": 0},
            "params": {"mode": "auto", "pool_bytes": 64 << 20, "checksum": True},
        },
        {
            "name": "put",
            "type": "put",
            "after": "gather",
            "workers": 2,
            "threads": 2,
            "capacity": 1024,
            "batch": {"max_items": 256, "max_wait_ms": 1},
            "params": {
                "max_buffers_per_call": MAX_BUFFERS_PER_CALL,
                "throttle": {"slow_s": 0.25, "recovered_s": 0.05, "probe_every_s": 0.5},
                "seal": True,
            },
        },
    ]
}


def default_save_graph(
    kv: KVCache,
    store: SavingStore,
    *,
    enable_group_semantics: bool | str = False,
    max_buffers_per_call: int = MAX_BUFFERS_PER_CALL,
    gather: str = "auto",
    throttle: ThrottleParams | None = DEFAULT_THROTTLE,
    observer: ObjectObserver | None = None,
    integrity: Integrity | str = Integrity.VERIFY,
    max_pinned_bytes: int = 0,
    soft_pin_ttl_s: float = 600.0,
    loaded_keys: LoadedKeys | None = None,
) -> Graph:
    """The default save graph over ``kv`` and ``store``.

    ``enable_group_semantics`` is parsed strictly (``"true"``/``"false"`` strings
    accepted, anything else is an error naming the field). ``gather`` is the
    gather stage's mode (``auto``, ``always``, ``never``). ``throttle`` is the
    put stage's slow-store detector (None: never skip a put). ``observer`` is
    told the final status of every object. ``integrity`` ``off`` writes no
    seals; ``verify`` and ``required`` seal every object put (:mod:`.integrity`).
    ``max_pinned_bytes`` and ``soft_pin_ttl_s``: the put stage's retention budget
    (:mod:`.retention`; 0 bytes: no object is pinned); ``loaded_keys``, shared with
    the engine's load graph, has each load count for the pins it reads.
    """
    document = copy.deepcopy(DEFAULT_SAVE_PIPELINE)
    stages = {stage["name"]: stage for stage in document["stages"]}
    stages["group_ids"]["params"]["enable_group_semantics"] = enable_group_semantics
    stages["put"]["params"]["max_buffers_per_call"] = max_buffers_per_call
    stages["gather"]["params"]["mode"] = gather
    stages["put"]["params"]["throttle"] = None if throttle is None else throttle.model_dump()
    stages["put"]["params"]["seal"] = Integrity(integrity) is not Integrity.OFF
    stages["gather"]["params"]["checksum"] = stages["put"]["params"]["seal"]  # for the seals
    stages["put"]["params"]["max_pinned_bytes"] = max_pinned_bytes
    stages["put"]["params"]["soft_pin_ttl_s"] = soft_pin_ttl_s
    return build_graph(
        document, KV_STAGES, {"kv": kv, "store": store, "observer": observer, "loaded_keys": loaded_keys}
    )
