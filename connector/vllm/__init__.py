"""kvpipe as a vLLM 0.32 KV connector: save KV-cache blocks into Mooncake Store, load hits back.

Load it with::

    KVTransferConfig(kv_connector="KVPipeConnector", kv_connector_module_path="kvpipe.connector.vllm",
                     kv_role="kv_both", kv_connector_extra_config={...})

``kv_connector_extra_config`` (validated by :class:`ConnectorSettings`; unknown keys are errors):

- ``store``: ``{kind: mooncake, master: "host:port", metadata_server: ..., ...}`` or
  ``{kind: memory}`` (in-process only, for unit use). Without it the store comes from
  vLLM's Mooncake JSON (``MOONCAKE_CONFIG_PATH``), so existing vLLM setups work as they are.
- ``enable_group_semantics`` (true/false, strict), ``cache_prefix``, ``queue_capacity``,
  ``max_buffers_per_call``, ``staging_blocks``, ``save_deadline_s`` (10) and
  ``load_deadline_s`` (5): past its deadline a job starts no new store call.
- ``config``: a kvpipe YAML file whose ``store`` and ``save`` sections give defaults;
  keys given inline override them.

How it works:

- Each role opens its own store client: in vLLM's default multiprocess mode the scheduler
  and the worker live in different processes. The scheduler only asks ``batch_is_exist``
  (it mounts no segment); the worker stores.
- Scheduler: a chunk is a hit when its key exists for every TP rank
  (:func:`~kvpipe.stages.longest_stored_prefix`). A lookup asks one ``batch_is_exist``
  for its keys and those of every request still waiting, and later lookups of the same
  scheduling step are answered from it: one store call per step, not per request. Loads are synchronous, so a loaded prefix
  is in vLLM's own prefix cache for the requests after it in the same step.
  ``build_connector_meta`` plans, per request, the load (once) and the save of the
  chunks completed by the end of this step, each chunk offered once.
- Worker: at the end of a step (``wait_for_save``) the blocks to save are copied into a
  staging area the connector owns, object-major so each object is one buffer
  (:mod:`.staging`), and a :class:`~kvpipe.stages.SaveRequest` over the staging slots
  goes to the save pipeline (``SyncPipeline`` with ``when_full="drop"``).
  The step never waits on the store, and vLLM may reuse the engine blocks at once; the
  slots are freed when the save job completes. With no free slot a save is dropped and
  counted. Loads run synchronously in ``start_load_kv`` through the load pipeline;
  blocks that failed go to ``get_block_ids_with_load_errors``. With vLLM's default
  ``kv_load_failure_policy="fail"`` such a request fails; ``"recompute"`` (which the
  connector recommends with a warning at start) turns a failed load into a miss.

Importing this package does not import vLLM (~6 s): the connector classes load on
first use, so :mod:`.launch` serves processes that only build configs and spawn
engines (the bench's parent) at no such cost.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .engine_cache import groups_of
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
    "KVPipeConnector",
    "KVPipeMetadata",
    "KVPipeStats",
    "groups_of",
    "settings_from",
]
