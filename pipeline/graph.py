"""Wiring stages into a graph, checked before anything runs.

A :class:`StageSpec` names a stage and says what feeds it: ``after=("project.tail",)``
reads the ``tail`` port of ``project``; a bare name means its ``out`` port. A port
may feed several stages (each gets every item: fan-out) and a stage may be fed by
several ports (fan-in: they share its bounded inbox). Exactly one stage has no
``after``: the entry, where submitted items go.

:class:`Graph` validates all of it at construction, so a miswired pipeline is one
clear error at build time rather than items silently piling up at run time:
duplicate or unknown names, unknown ports, ports nobody reads, cycles, batch
settings on a stage that does not batch, and declared item types that do not fit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import BuildError
from .stage import DEFAULT_PORT, AnyStage, BatchStage, Stage

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class BatchPolicy:
    """Flush a batch at ``max_items`` items or ``max_wait_s`` after its first item.

    ``max_wait_s=0`` batches greedily: whatever is queued right now, so batches
    grow with load and an idle pipeline adds no latency.
    """

    max_items: int = 256
    max_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_items <= 0:
            raise BuildError(f"batch.max_items: must be > 0, got {self.max_items}")
        if self.max_wait_s < 0:
            raise BuildError(f"batch.max_wait_s: must be >= 0, got {self.max_wait_s}")


@dataclass(frozen=True)
class StageSpec:
    name: str
    stage: AnyStage
    after: tuple[str, ...] = ()
    workers: int = 1
    capacity: int = 64  # bound of this stage's inbox, in items
    batch: BatchPolicy | None = None

    @property
    def is_batch(self) -> bool:
        return isinstance(self.stage, BatchStage)

    @property
    def batch_policy(self) -> BatchPolicy:
        return self.batch or BatchPolicy()


@dataclass(frozen=True)
class Edge:
    source: str
    port: str
    target: str


def parse_ref(ref: str) -> tuple[str, str]:
    """``"project.tail"`` -> ``("project", "tail")``; ``"filter"`` -> ``("filter", "out")``."""
    name, _, port = ref.partition(".")
    return name, port or DEFAULT_PORT


class GraphError(BuildError):
    """A wiring error; ``stage`` names the stage it is about, ``index`` its place if the name is not enough."""

    def __init__(self, stage: str, message: str, index: int | None = None) -> None:
        super().__init__(f"stage {stage!r}: {message}")
        self.stage = stage
        self.index = index


@dataclass(frozen=True)
class Graph:
    specs: tuple[StageSpec, ...]
    entry: str = field(init=False)
    edges: tuple[Edge, ...] = field(init=False)
    order: tuple[str, ...] = field(init=False)  # topological, entry first

    def __init__(self, specs: Iterable[StageSpec]) -> None:
        """Check the wiring of ``specs`` (see the module docstring).

        Raises :class:`GraphError` (a :class:`~.errors.BuildError` whose ``stage``
        names the stage) when a stage's name, settings, wiring or item types are wrong,
        and BuildError when there are no stages or not exactly one entry.
        """
        object.__setattr__(self, "specs", tuple(specs))
        by_name = self._check_names()
        edges = self._check_edges(by_name)
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "entry", self._check_entry())
        object.__setattr__(self, "order", self._check_acyclic(edges))
        self._check_ports(edges)
        self._check_types(by_name, edges)

    def spec(self, name: str) -> StageSpec:
        return next(s for s in self.specs if s.name == name)

    def targets(self, source: str, port: str) -> list[str]:
        return [e.target for e in self.edges if e.source == source and e.port == port]

    def producers(self, target: str) -> list[Edge]:
        return [e for e in self.edges if e.target == target]

    # -- checks -------------------------------------------------------------

    def _check_names(self) -> dict[str, StageSpec]:
        if not self.specs:
            raise BuildError("a pipeline needs at least one stage")
        by_name: dict[str, StageSpec] = {}
        for index, spec in enumerate(self.specs):
            if not _NAME.match(spec.name):
                raise GraphError(spec.name, "a name is letters, digits, '_' or '-', starting with a letter")
            if spec.name in by_name:
                raise GraphError(spec.name, "two stages have this name", index)
            if not isinstance(spec.stage, Stage | BatchStage):
                raise GraphError(
                    spec.name, f"{type(spec.stage).__name__} is neither a Stage nor a BatchStage"
                )
            if spec.workers <= 0:
                raise GraphError(spec.name, f"workers: must be > 0, got {spec.workers}")
            if spec.capacity <= 0:
                raise GraphError(spec.name, f"capacity: must be > 0, got {spec.capacity}")
            if spec.batch is not None and not spec.is_batch:
                raise GraphError(
                    spec.name, f"batch settings given, but {type(spec.stage).__name__} is not a BatchStage"
                )
            by_name[spec.name] = spec
        return by_name

    def _check_edges(self, by_name: dict[str, StageSpec]) -> tuple[Edge, ...]:
        edges: list[Edge] = []
        for spec in self.specs:
            for ref in spec.after:
                source, port = parse_ref(ref)
                if source not in by_name:
                    raise GraphError(spec.name, f"after {ref!r}: there is no stage {source!r}")
                ports = by_name[source].stage.ports
                if port not in ports:
                    raise GraphError(
                        spec.name,
                        f"after {ref!r}: stage {source!r} has no port {port!r} (ports: {_names(ports)})",
                    )
                edge = Edge(source, port, spec.name)
                if edge in edges:
                    raise GraphError(spec.name, f"after {ref!r} is given twice")
                edges.append(edge)
        return tuple(edges)

    def _check_entry(self) -> str:
        entries = [s.name for s in self.specs if not s.after]
        if len(entries) != 1:
            raise BuildError(
                f"exactly one stage must have no 'after' (the entry), found {len(entries)}: {_names(entries)}"
            )
        return entries[0]

    def _check_acyclic(self, edges: Sequence[Edge]) -> tuple[str, ...]:
        incoming = {s.name: {e.source for e in edges if e.target == s.name} for s in self.specs}
        order: list[str] = []
        ready = [name for name, sources in incoming.items() if not sources]
        while ready:
            name = ready.pop(0)
            order.append(name)
            for target, sources in incoming.items():
                if name in sources:
                    sources.discard(name)
                    if not sources and target not in order and target not in ready:
                        ready.append(target)
        if len(order) != len(self.specs):
            stuck = [s.name for s in self.specs if s.name not in order]
            raise GraphError(stuck[0], f"is part of a cycle ({_names(stuck)})")
        return tuple(order)

    def _check_ports(self, edges: Sequence[Edge]) -> None:
        for spec in self.specs:
            for port in spec.stage.ports:
                if not any(e.source == spec.name and e.port == port for e in edges):
                    raise GraphError(spec.name, f"port {port!r} is not connected to any stage")

    def _check_types(self, by_name: dict[str, StageSpec], edges: Sequence[Edge]) -> None:
        for edge in edges:
            produced = by_name[edge.source].stage.output_types.get(edge.port, Any)
            accepted = by_name[edge.target].stage.input_type
            if not _fits(produced, accepted):
                raise GraphError(
                    edge.target,
                    f"accepts {_type_name(accepted)} but {edge.source}.{edge.port} emits {_type_name(produced)}",
                )


def _fits(produced: Any, accepted: Any) -> bool:
    if produced is Any or accepted is Any:
        return True
    if isinstance(produced, type) and isinstance(accepted, type):
        return issubclass(produced, accepted)
    return bool(produced == accepted)


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", repr(t))


def _names(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names) or "none"
