"""The KV save and load stages by type name, for pipelines built from YAML.

Factories take their objects from the build's resources: ``kv`` (the engine's
:class:`KVCache`), ``store`` (a :class:`SavingStore`) and, optionally,
``observer`` (an :class:`ObjectObserver` told the outcome of every object). A resource of the wrong
kind is a build error naming it, not an AttributeError at the first request.

The load stage takes the same ``kv`` and ``store`` (a :class:`LoadingStore`) and,
optionally, ``load_observer`` (told each load request's failed block ids) and
``layer_observer`` (told each wave of a layered load as it lands).

Optionally too, ``loaded_keys`` (a :class:`LoadedKeys`) given to both graphs of one
engine: the load stage tells it each object it loads, the put stage's retention
budget counts those as requests for the chunks it holds pinned.
"""

from __future__ import annotations

from typing import TypeVar

from kvpipe.pipeline.errors import BuildError
from kvpipe.pipeline.registry import NoParams, Resources, StageRegistry

from .filter import FilterStage
from .full_and_tail import FullChunksStage, TailStage
from .gather import GatherParams, GatherStage
from .group_ids import GroupIdsParams, GroupIdsStage
from .integrity import fingerprint
from .layers import common_waves
from .load import LoadParams, LoadStage
from .model import KVCache
from .project import ProjectStage
from .put import PutParams, PutStage
from .retention import LoadedKeys
from .store import LoadingStore, SavingStore

KV_STAGES = StageRegistry()

T = TypeVar("T")


def _resource(resources: Resources, name: str, kind: type[T]) -> T:
    value = resources[name]
    if not isinstance(value, kind):
        raise BuildError(f"resource {name!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _kv(resources: Resources) -> KVCache:
    return _resource(resources, "kv", KVCache)


def _loaded_keys(resources: Resources) -> LoadedKeys | None:
    return (
        _resource(resources, "loaded_keys", LoadedKeys) if resources.get("loaded_keys") is not None else None
    )


# A runtime_checkable Protocol is only isinstance'd here, never instantiated (mypy#4717).
def _store(resources: Resources) -> SavingStore:
    return _resource(resources, "store", SavingStore)  # type: ignore[type-abstract]


def _loading_store(resources: Resources) -> LoadingStore:
    return _resource(resources, "store", LoadingStore)  # type: ignore[type-abstract]


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
    return FilterStage(_store(resources), resources.get("observer"))


@KV_STAGES.register("gather", GatherParams)
def _build_gather(params: GatherParams, resources: Resources) -> GatherStage:
    return GatherStage(params, _kv(resources), _store(resources))


@KV_STAGES.register("put", PutParams)
def _build_put(params: PutParams, resources: Resources) -> PutStage:
    kv = _kv(resources)
    return PutStage(
        params,
        _store(resources),
        resources.get("observer"),
        fingerprint=fingerprint(kv) if params.seal else None,
        loads=_loaded_keys(resources),
        layer_waves=common_waves(kv),
    )


@KV_STAGES.register("load", LoadParams)
def _build_load(params: LoadParams, resources: Resources) -> LoadStage:
    return LoadStage(
        params,
        _kv(resources),
        _loading_store(resources),
        resources.get("load_observer"),
        _loaded_keys(resources),
        resources.get("layer_observer"),
    )
