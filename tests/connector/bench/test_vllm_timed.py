"""The vLLM bench's timed connector: what its kvpipe engines load, and which hooks it times."""

from __future__ import annotations

import importlib

from kvpipe.connector.bench.vllm_prefix import STEP_HOOK, timed_transfer
from kvpipe.connector.bench.vllm_timed import (
    BOTH_HOOKS,
    SCHEDULER_HOOKS,
    WORKER_HOOKS,
    TimedKVPipeConnector,
)
from kvpipe.connector.engines.launch import kvpipe_transfer
from kvpipe.connector.vllm import KVPipeConnector


def test_the_transfer_config_names_the_timed_connector_and_keeps_the_settings() -> None:
    transfer = timed_transfer(kvpipe_transfer({"integrity": "off"}))
    module = importlib.import_module(transfer["kv_connector_module_path"])

    assert getattr(module, transfer["kv_connector"]) is TimedKVPipeConnector
    assert transfer["kv_connector_extra_config"] == {"integrity": "off"}


def test_every_timed_hook_is_kvpipes_own_method() -> None:
    # a hook vLLM's base class answers costs kvpipe nothing: timing it would measure vLLM
    for name in SCHEDULER_HOOKS + WORKER_HOOKS + BOTH_HOOKS:
        assert name in vars(KVPipeConnector), name
        assert getattr(TimedKVPipeConnector, name) is not getattr(KVPipeConnector, name), name


def test_steps_are_counted_by_a_timed_scheduler_hook() -> None:
    assert STEP_HOOK in SCHEDULER_HOOKS
