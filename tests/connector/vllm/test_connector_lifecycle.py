"""KVPipeConnector built as vLLM builds it (a real VllmConfig and KVCacheConfig), without an engine."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvpipe.connector.engines import launch
from kvpipe.stages.errors import ConfigError

from . import engine


def vllm_config(extra: dict[str, Any]) -> Any:
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    model = ModelConfig(
        model=str(engine.MODEL_DIR),
        skip_tokenizer_init=True,
        max_model_len=512,
        dtype="bfloat16",
        enforce_eager=True,
    )
    transfer = KVTransferConfig(**launch.kvpipe_transfer(extra, load_failure_policy="recompute"))
    return VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=16), kv_transfer_config=transfer
    )


def kv_cache_config(groups: int = 1) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=32, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{g}"], spec) for g in range(groups)],
        hash_block_size=16,
    )


def connector(extra: dict[str, Any], role: str = "WORKER", groups: int = 1) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpipe.connector.vllm import KVPipeConnector

    return KVPipeConnector(vllm_config(extra), KVConnectorRole[role], kv_cache_config(groups))


def test_shutting_one_connector_down_leaves_the_shared_memory_store_open_for_the_others() -> None:
    extra = {"store": {"kind": "memory", "capacity": "8MB"}}
    first, second = connector(extra), connector(extra)
    # breaker, meter, then one process-wide memory store under both
    assert first.store.inner.inner is second.store.inner.inner
    first.shutdown()
    assert first.store is None
    assert second.store.batch_is_exist(["k"]) == [0]  # open: -900 once closed
    second.shutdown()


def test_sync_loads_are_refused_for_a_model_of_several_kv_cache_groups() -> None:
    with pytest.raises(ConfigError, match="load_async: false cannot serve a model with 2 KV-cache groups"):
        connector({"store": {"kind": "memory"}, "load_async": False}, groups=2)


def test_a_bad_flag_names_the_field_and_the_value() -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config.load_async.*'sometimes'"):
        connector({"store": {"kind": "memory"}, "load_async": "sometimes"})


def test_sleep_and_wake_up_reach_the_workers_registrations() -> None:
    """vLLM 0.33 calls unregister_kv_caches before sleep frees the KV caches, restore_kv_caches after (loads in place)."""
    worker = connector({"store": {"kind": "memory", "capacity": "8MB"}, "staging_blocks": 2, "load_via_staging": False})
    layer = torch.zeros(8, 4, 16, 64, dtype=torch.bfloat16)
    worker.register_kv_caches({"layer.0": layer})
    memory = worker.store.inner.inner
    address = layer.untyped_storage().data_ptr()
    assert address in memory._registered
    worker.unregister_kv_caches()
    assert address not in memory._registered
    worker.restore_kv_caches()
    assert address in memory._registered
    worker.shutdown()


def test_pcp_over_several_stored_groups_is_refused_as_vllms_connector_refuses_it() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpipe.connector.vllm import KVPipeConnector

    config = vllm_config({"store": {"kind": "memory"}})
    config.parallel_config.prefill_context_parallel_size = 2
    with pytest.raises(ConfigError, match="prefill_context_parallel_size=2 with 2 stored KV-cache groups"):
        KVPipeConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(groups=2))


def test_an_untested_vllm_release_is_named_in_a_warning_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    import structlog

    from kvpipe.connector.vllm import connector as module

    monkeypatch.setattr(module, "vllm_version", lambda: "0.40.0")
    with structlog.testing.capture_logs() as logs:
        connector({"store": {"kind": "memory"}}, role="SCHEDULER").shutdown()
    assert any(
        log["event"] == "kvpipe is not tested with this vLLM" and log["vllm"] == "0.40.0" for log in logs
    )
