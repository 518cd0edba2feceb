"""``group_ids`` gives each record the group of its own chunk, when enabled and supported."""

import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from kvpipe.connector.store.memory import LegacyReplicateConfig, MemoryReplicateConfig, MemoryStore
from kvpipe.connector.store.protocol import replicate_config_supports_group_ids
from kvpipe.pipeline.testing import RecordingEmit
from kvpipe.stages import GroupIdsParams, GroupIdsStage, StoreObject, group_id

from .kv_fixtures import make_kv
from .stores import ScriptedStore

HASHES = (b"\x01" * 4, b"\x02" * 4, b"\x03" * 4)


def _records():
    return tuple(
        StoreObject(key=f"key-{i}", chunk_hash=h, store_group=0, buffers=()) for i, h in enumerate(HASHES)
    )


async def _run(stage, records):
    await stage.process(records, emit := RecordingEmit())
    (out,) = emit.emitted["out"]
    return out


async def test_enabled_and_supported_each_record_gets_the_group_of_its_own_chunk_hash():
    kv = make_kv(shards=2, cache_prefix="pfx").kv
    stage = GroupIdsStage(GroupIdsParams(enable_group_semantics=True), kv, MemoryStore())

    out = await _run(stage, _records())

    namespace = kv.shards[0].namespace
    assert [r.group_id for r in out] == [group_id(namespace, h) for h in HASHES]
    assert out[0].group_id == "vllm-mooncake-store:pfx@tiny-llama@01010101"
    assert [(r.key, r.chunk_hash) for r in out] == [(r.key, r.chunk_hash) for r in _records()]


async def test_disabled_records_pass_unchanged():
    kv = make_kv().kv
    records = _records()

    out = await _run(GroupIdsStage(GroupIdsParams(), kv, MemoryStore()), records)

    assert out is records


def test_a_stage_with_nothing_to_attach_says_it_passes_through():
    kv = make_kv().kv
    assert GroupIdsStage(GroupIdsParams(), kv, MemoryStore()).passes_through
    unsupported = MemoryStore(group_ids_supported=False)
    assert GroupIdsStage(GroupIdsParams(enable_group_semantics=True), kv, unsupported).passes_through
    assert not GroupIdsStage(GroupIdsParams(enable_group_semantics=True), kv, MemoryStore()).passes_through


async def test_enabled_but_unsupported_warns_once_at_build_and_records_pass_unchanged():
    kv = make_kv().kv
    records = _records()

    with capture_logs() as logs:
        stage = GroupIdsStage(
            GroupIdsParams(enable_group_semantics="true"), kv, MemoryStore(group_ids_supported=False)
        )
        first = await _run(stage, records)
        second = await _run(stage, records)

    assert [entry["log_level"] for entry in logs] == ["warning"]
    assert "group" in logs[0]["event"]
    assert first is records and second is records


def test_a_misspelt_flag_is_refused_with_the_field_name():
    with pytest.raises(ValidationError, match="enable_group_semantics: expected true or false, got 'flase'"):
        GroupIdsParams(enable_group_semantics="flase")


def test_unknown_params_are_refused():
    with pytest.raises(ValidationError, match="enable_group_semantic"):
        GroupIdsParams(enable_group_semantic=True)


class _InstanceOnlyConfig:
    """A replicate config that sets ``group_ids`` per object but does not declare it on the class."""

    def __init__(self) -> None:
        self.group_ids = None


@pytest.mark.parametrize(
    ("config_class", "supported"),
    [(MemoryReplicateConfig, True), (_InstanceOnlyConfig, True), (LegacyReplicateConfig, False)],
    ids=["on-the-class", "on-an-instance-only", "on-neither"],
)
async def test_group_ids_follow_the_store_capability_detected_from_its_replicate_config(
    config_class, supported
):
    kv = make_kv().kv
    store = ScriptedStore(
        supports_group_ids=replicate_config_supports_group_ids(config_class, config_class())
    )

    with capture_logs() as logs:
        stage = GroupIdsStage(GroupIdsParams(enable_group_semantics=True), kv, store)
        out = await _run(stage, _records())

    assert [r.group_id is not None for r in out] == [supported] * len(HASHES)
    assert len(logs) == (0 if supported else 1)
