"""The save and load stages are registered by name and built from the build's resources."""

import pytest
from pydantic import ValidationError

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.pipeline.errors import BuildError
from kvpipe.pipeline.registry import Resources
from kvpipe.stages import (
    KV_STAGES,
    FilterStage,
    FullChunksStage,
    GatherStage,
    GroupIdsStage,
    LoadStage,
    ProjectStage,
    PutStage,
    TailStage,
)

from .kv_fixtures import make_kv

BUILT = {
    "project": ProjectStage,
    "full": FullChunksStage,
    "tail": TailStage,
    "group_ids": GroupIdsStage,
    "filter": FilterStage,
    "gather": GatherStage,
    "put": PutStage,
    "load": LoadStage,
}


def _build(name, params=None, **resources):
    stage_type = KV_STAGES[name]
    return stage_type.build(stage_type.params.model_validate(params or {}), Resources(resources))


def test_the_save_and_load_stage_types_are_registered():
    assert KV_STAGES.names() == sorted(BUILT)


@pytest.mark.parametrize(("name", "stage_class"), BUILT.items())
def test_each_type_builds_its_stage_from_kv_and_store(name, stage_class):
    assert isinstance(_build(name, kv=make_kv().kv, store=MemoryStore()), stage_class)


def test_params_are_validated_with_the_field_named():
    with pytest.raises(ValidationError, match="max_buffers_per_call"):
        KV_STAGES["put"].params.model_validate({"max_buffers_per_call": -1})


def test_stages_without_params_refuse_any():
    with pytest.raises(ValidationError, match="workers_per_thing"):
        KV_STAGES["filter"].params.model_validate({"workers_per_thing": 2})


def test_a_missing_resource_is_a_build_error_naming_it():
    with pytest.raises(BuildError, match="resource 'store' is needed"):
        _build("filter", kv=make_kv().kv)


def test_a_resource_of_the_wrong_kind_is_a_build_error_naming_it():
    with pytest.raises(BuildError, match="resource 'kv' must be a KVCache, got dict"):
        _build("project", kv={"groups": []})
