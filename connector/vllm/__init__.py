"""kvpipe as a vLLM 0.32 KV connector: save KV-cache blocks into Mooncake Store, load hits back.

Load it with::

    KVTransferConfig(kv_connector="KVPipeConnector", kv_connector_module_path="kvpipe.connector.vllm",
                     kv_role="kv_both", kv_connector_extra_config={...})

``kv_connector_extra_config`` is validated by :class:`ConnectorSettings` (unknown keys are
errors). Each key is documented once, by its field's description in :mod:`.settings`;
docs/vllm-connector.md's settings table is rendered from them. Without ``store`` the
store comes from vLLM's Mooncake JSON (``MOONCAKE_CONFIG_PATH``), so existing vLLM
setups work as they are.

The modules, one job each:

- :mod:`.connector`: the class vLLM loads; it hands each call to its role's object.
- :mod:`.scheduler`: lookups (one store call per scheduling step), load planning
  (one load per shared prefix, a stale hit recomputes once) and save planning.
- :mod:`.worker`: the engine's KV memory and the saves of each step; it owns the loads.
- :mod:`.loads`: the loads a step starts, their deadlines and slots, and what failed, for vLLM.
- :mod:`.registrations`: the memory the worker registers with the store (and sleep mode lets go of).
- :mod:`.kv_layout`: engine KV tensors -> block layouts, for every layout vLLM has.
- :mod:`.store_format`: rank-local or TP-sharded objects, as vLLM's connector chooses.
- :mod:`.staging_area`: host slots that hold whole objects (saves; loads of device caches).
- :mod:`.device`: the copies to and from device blocks, batched on a side stream.
- :mod:`.engine_cache`: what both roles derive from vLLM's config, and the store they open.
- :mod:`.settings`, :mod:`.messages`: ``kv_connector_extra_config``; what crosses processes.
- :mod:`.metrics`, :mod:`.prom`, :mod:`.events`: the one catalogue of the connector's
  metrics, their Prometheus series, and the KV events vLLM's router reads.

Each role opens its own store client: in vLLM's default multiprocess mode the
scheduler and the worker live in different processes. The scheduler only asks
``batch_is_exist`` (it mounts no segment); the worker stores and loads. With vLLM's
default ``kv_load_failure_policy="fail"`` a failed load fails its request;
``"recompute"`` (which the connector recommends with a warning at start) turns it
into a miss.

Importing this package does not import vLLM (~6 s): the connector classes load on
first use, so a process that only builds configs and spawns engines (the bench's
parent, :mod:`kvpipe.connector.engines.launch`) pays no such cost.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .engine_cache import EngineCache, groups_of
from .settings import ConnectorSettings, settings_from

if TYPE_CHECKING:
    from .connector import KVPipeConnector
    from .messages import KVPipeMetadata, KVPipeStats

#: names that need vLLM, and the module each comes from
_NEEDS_VLLM = {"KVPipeConnector": ".connector", "KVPipeMetadata": ".messages", "KVPipeStats": ".messages"}


def __getattr__(name: str) -> Any:
    if name not in _NEEDS_VLLM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_NEEDS_VLLM[name], __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ConnectorSettings",
    "EngineCache",
    "KVPipeConnector",
    "KVPipeMetadata",
    "KVPipeStats",
    "groups_of",
    "settings_from",
]
