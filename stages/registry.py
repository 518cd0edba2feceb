"""The KV save stages by type name, for pipelines built from YAML.

Factories take their objects from the build's resources: ``kv`` (the engine's
:class:`KVCache`) and ``store`` (an :class:`ObjectStore`). A resource of the wrong
kind is a build error naming it, not an AttributeError at the first request.
"""

from __future__ import annotations

from typing import Any

from kvpipe.pipeline.errors import BuildError
from kvpipe.pipeline.registry import NoParams, Resources, StageRegistry

from .collect import FullChunksStage, TailStage
from .filter import FilterStage
from .group_ids import GroupIdsParams, GroupIdsStage
from .model import KVCache
from .project import ProjectStage
from .put import PutParams, PutStage
from .store import ObjectStore

KV_STAGES = StageRegistry()


def _resource(resources: Resources, name: str, kind: type) -> Any:
    value = resources[name]
    if not isinstance(value, kind):
        raise BuildError(f"resource {name!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _kv(resources: Resources) -> KVCache:
    return _resource(resources, "kv", KVCache)


def _store(resources: Resources) -> ObjectStore:
    return _resource(resources, "store", ObjectStore)


@KV_STAGES.register("project")
def _build_project(params: NoParams, resources: Resources) -> ProjectStage:
    return ProjectStage(_kv(resources))


@KV_STAGES.register("full")
def _build_full(params: NoParams, resources: Resources) -> FullChunksStage:
    return FullChunksStage(_kv(resources))


@KV_STAGES.register("tail")
def _build_tail(params: NoParams, resources: Resources) -> TailStage:
    return TailStage(_kv(resources))


@KV_STAGES.register("group_ids", GroupIdsParams)
def _build_group_ids(params: GroupIdsParams, resources: Resources) -> GroupIdsStage:
    return GroupIdsStage(params, _kv(resources), _store(resources))


@KV_STAGES.register("filter")
def _build_filter(params: NoParams, resources: Resources) -> FilterStage:
    return FilterStage(_store(resources))


@KV_STAGES.register("put", PutParams)
def _build_put(params: PutParams, resources: Resources) -> PutStage:
    return PutStage(params, _store(resources))
