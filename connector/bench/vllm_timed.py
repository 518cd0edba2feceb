"""kvpipe's connector with every per-step hook timed: what the vLLM bench's kvpipe engines load.

The bench names this module and :class:`TimedKVPipeConnector` in vLLM's
``kv_transfer_config`` (:func:`.vllm_prefix.timed_transfer`), so production's
:class:`~kvpipe.connector.vllm.KVPipeConnector` pays nothing for the measure. In
the bench's engines (in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's
uniprocess executor) the scheduler, the worker and the model all run on the
thread that serves the engine's commands, so :data:`CLOCK`, shared by both roles'
connectors, times every hook on the engine's own thread, and the engine process
reads it back on that thread (:mod:`.vllm_engine`'s ``hook_times`` command).

The timing costs ~10 us a hook call (two schedstat and two thread-clock reads; ~23
calls a step, ~0.25 ms): kvpipe's engines' pass times and the engine thread's CPU
carry it, the hooks' CPU only the one clock read inside each timed span.

Importing this module imports vLLM: the bench's parent process only names it, by strings.
"""

from __future__ import annotations

from kvpipe.connector.vllm import KVPipeConnector

from .hook_clock import HookClock, timed_hooks

#: The hooks vLLM calls per step or per request (lifecycle calls, e.g. registering
#: the KV caches or shutting down, happen once and are left out).
SCHEDULER_HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",  # once per scheduler step: the bench counts steps by it
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
)
WORKER_HOOKS = (
    "handle_preemptions",  # where the engine thread waits for the last step's save copies
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_kv_cache_events",
)
BOTH_HOOKS = ("get_kv_connector_stats",)

#: Both roles' hook times in this process: the engine's thread's.
CLOCK = HookClock()


@timed_hooks(CLOCK, SCHEDULER_HOOKS + WORKER_HOOKS + BOTH_HOOKS)
class TimedKVPipeConnector(KVPipeConnector):
    """kvpipe's connector, each hook timed on :data:`CLOCK` (arguments and answers untouched)."""
