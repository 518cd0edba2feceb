"""The connector's configuration: ``kv_connector_extra_config`` validated, errors naming field and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.connector.vllm import KVPipeStats, settings_from
from kvpipe.stages import ConfigError, Integrity


def test_defaults_and_inline_values() -> None:
    settings = settings_from(
        {"store": {"kind": "memory"}, "enable_group_semantics": "TRUE", "staging_blocks": 8}
    )
    assert settings.enable_group_semantics is True
    assert settings.staging_blocks == 8
    assert settings.store is not None and settings.store.kind == "memory"
    assert settings_from(None).store is None  # then MOONCAKE_CONFIG_PATH decides


def test_saves_yield_the_cpu_to_the_engine_and_idle_loads_run_sync_by_default() -> None:
    settings = settings_from(None)

    assert settings.save_nice == 10
    assert settings.load_async and settings.load_sync_when_idle


def test_every_save_and_load_job_has_a_deadline_by_default() -> None:
    settings = settings_from(None)

    assert (settings.save_deadline_s, settings.load_deadline_s) == (10.0, 5.0)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"enable_group_semantics": "flase"}, ["enable_group_semantics", "'flase'"]),
        ({"staging_blocks": 0}, ["staging_blocks", "0"]),
        ({"store": {"kind": "redis"}}, ["store", "redis"]),
        ({"queue_capcity": 3}, ["queue_capcity", "3"]),
        ({"load_deadline_s": 0}, ["load_deadline_s", "0"]),
        ({"save_deadline_s": "soon"}, ["save_deadline_s", "'soon'"]),
        ({"save_nice": 20}, ["save_nice", "20"]),
        ({"save_nice": "5"}, ["save_nice", "'5'"]),
        ({"load_sync_when_idle": "sometimes"}, ["load_sync_when_idle", "'sometimes'"]),
        ({"retention": "yes"}, ["retention", "'yes'"]),
        ({"retention_min_requests": 0}, ["retention_min_requests", "0"]),
        ({"retention_pin_ttl_s": 90000}, ["retention_pin_ttl_s", "90000"]),
        ({"retention_max_pinned": "lots"}, ["retention_max_pinned", "'lots'"]),
    ],
)
def test_bad_values_name_the_field_and_the_value(extra: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigError) as error:
        settings_from(extra)
    for word in words:
        assert word in str(error.value)


def test_a_kvpipe_yaml_gives_defaults_and_inline_keys_win(tmp_path: Path) -> None:
    path = tmp_path / "kvpipe.yaml"
    path.write_text("store:\n  kind: memory\nsave:\n  enable_group_semantics: true\n  cache_prefix: team-a\n")
    settings = settings_from({"config": str(path), "cache_prefix": "team-b"})
    assert settings.store is not None and settings.store.kind == "memory"
    assert settings.enable_group_semantics is True
    assert settings.cache_prefix == "team-b"
    with pytest.raises(ConfigError, match="config"):
        settings_from({"config": str(tmp_path / "missing.yaml")})


def test_a_kvpipe_yaml_takes_the_word_off(tmp_path: Path) -> None:
    path = tmp_path / "kvpipe.yaml"
    path.write_text("save:\n  integrity: off\n")
    assert settings_from({"config": str(path)}).integrity is Integrity.OFF


def test_stats_aggregate_and_reduce() -> None:
    stats = KVPipeStats(data={"objects_put": 2})
    stats.aggregate(KVPipeStats(data={"objects_put": 3, "loads": 1}))
    assert stats.reduce() == {"objects_put": 5, "loads": 1}
    assert not stats.is_empty()
    stats.reset()
    assert stats.is_empty()


def test_the_staging_area_holds_the_same_tokens_whatever_the_block_size() -> None:
    settings = settings_from({"store": {"kind": "memory"}})
    assert settings.staging_slots([128]) == 256
    assert settings.staging_slots([16]) == 2048  # MLA on CPU_MLA: 8x the blocks, the same tokens
    assert settings.staging_slots([640, 640]) == 2 * 52  # a chunk takes a slot in every group


def test_staging_blocks_is_the_slot_count_itself() -> None:
    settings = settings_from({"store": {"kind": "memory"}, "staging_blocks": 8})
    assert settings.staging_slots([16]) == 8


def test_by_default_a_worker_pins_at_most_most_of_the_memory_it_lends() -> None:
    settings = settings_from(None)

    assert settings.retention
    assert settings.max_pinned_bytes(1000).pinned_bytes == 900


def test_retention_max_pinned_is_a_size_that_overrides_the_share() -> None:
    settings = settings_from({"retention_max_pinned": "64MB"})

    assert settings.max_pinned_bytes(0).pinned_bytes == 64 << 20


def test_with_retention_off_a_worker_pins_nothing() -> None:
    settings = settings_from({"retention": False, "retention_max_pinned": "64MB"})

    assert settings.max_pinned_bytes(1 << 30).pinned_bytes == 0


def test_vllm_connector_keys_for_its_own_machinery_are_accepted_and_named_in_a_log() -> None:
    """A deployment switches from vLLM's MooncakeStoreConnector without editing its config."""
    import structlog

    with structlog.testing.capture_logs() as logs:
        settings = settings_from({"lookup_rpc_port": 5555, "lookup_async": True, "cache_prefix": "p"})
    assert settings.cache_prefix == "p"
    assert {
        log["key"] for log in logs if log["event"] == "a vLLM connector setting kvpipe has no use for"
    } == {
        "lookup_rpc_port",
        "lookup_async",
    }
