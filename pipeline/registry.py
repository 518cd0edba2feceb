"""Stage types by name, each with its parameters declared as a pydantic model.

A YAML pipeline names stage types (``type: filter``) and gives them ``params``; the
registry says which class builds each name and how its params are validated, so a
typo in a YAML file is an error that names the field, not a crash deep in a stage.
A factory also receives the build's *resources* (e.g. the store a filter queries):
things that are objects, not configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from pydantic import BaseModel, ConfigDict

from .errors import BuildError
from .stage import AnyStage

P = TypeVar("P", bound=BaseModel)


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


Factory = Callable[[P, "Resources"], AnyStage]


class Resources:
    """Named objects a build hands to stage factories, with a clear error when missing."""

    def __init__(self, values: Mapping[str, Any] | None = None) -> None:
        self._values = dict(values or {})

    def __getitem__(self, name: str) -> Any:
        """The resource ``name``; raises :class:`~.errors.BuildError` (naming those given) when there is none."""
        try:
            return self._values[name]
        except KeyError:
            known = ", ".join(sorted(self._values)) or "none"
            raise BuildError(f"resource {name!r} is needed but was not given (given: {known})") from None

    def get(self, name: str, default: Any = None) -> Any:
        return self._values.get(name, default)


@dataclass(frozen=True)
class StageType(Generic[P]):
    name: str
    params: type[P]
    factory: Factory[P]

    def build(self, params: P, resources: Resources) -> AnyStage:
        return self.factory(params, resources)


class StageRegistry:
    def __init__(self) -> None:
        self._types: dict[str, StageType[Any]] = {}

    @overload
    def register(self, name: str) -> Callable[[Factory[NoParams]], Factory[NoParams]]: ...

    @overload
    def register(self, name: str, params: type[P]) -> Callable[[Factory[P]], Factory[P]]: ...

    def register(
        self, name: str, params: type[BaseModel] = NoParams
    ) -> Callable[[Factory[Any]], Factory[Any]]:
        """Decorate a factory ``(params, resources) -> stage`` to register it as ``name``.

        Without ``params`` the stage type takes none (:class:`NoParams`). The decorator
        raises ValueError when ``name`` is registered already.
        """

        def decorate(factory: Factory[Any]) -> Factory[Any]:
            if name in self._types:
                raise ValueError(f"stage type {name!r} is already registered")
            self._types[name] = StageType(name, params, factory)
            return factory

        return decorate

    def __getitem__(self, name: str) -> StageType[Any]:
        """The stage type ``name``; raises KeyError (naming the known ones) when there is none."""
        try:
            return self._types[name]
        except KeyError:
            raise KeyError(f"unknown stage type {name!r} (known: {', '.join(sorted(self._types))})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._types

    def names(self) -> list[str]:
        return sorted(self._types)
