"""Building a graph from YAML, with errors that point into the file.

The YAML names stage types from a :class:`~kvpipe.pipeline.registry.StageRegistry`
and wires them by name::

    stages:
      - {name: project, type: project}
      - {name: full, type: full, after: project.full}
      - {name: filter, type: filter, after: [full], batch: {max_items: 256}}

Everything is validated before any stage is built, and every error names its
place as a path from the document root, e.g.
``pipeline.stages[3].batch.max_items: must be > 0, got -1``. The graph's own
wiring checks (unknown names, cycles, unconnected ports) are reported at the
offending stage's path too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import BuildError
from .graph import BatchPolicy, Graph, GraphError, StageSpec
from .registry import Resources, StageRegistry

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails


class BatchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_items: int = Field(256, gt=0)
    max_wait_ms: float = Field(0.0, ge=0)


class StageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    type: str
    after: list[str] = Field(default_factory=list)
    workers: int = Field(1, gt=0)
    threads: int = Field(1, gt=0)
    capacity: int = Field(64, gt=0)
    batch: BatchConfig | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("after", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class PipelineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stages: list[StageConfig] = Field(min_length=1)


def one_line(problems: str) -> str:
    """The first of several problems (one per line), and how many more there are."""
    first, *rest = problems.splitlines()
    return f"{first} (and {len(rest)} more)" if rest else first


def format_path(root: str, loc: Sequence[str | int]) -> str:
    """``("stages", 3, "batch")`` under ``pipeline`` -> ``pipeline.stages[3].batch``."""
    path = root
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


_MESSAGES = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "missing": "is required",
    "extra_forbidden": "is not a known field",
    "union_tag_not_found": "needs its {discriminator} field",
}


def describe_validation_error(
    error: ValidationError,
    root: str,
    relocate: Callable[[tuple[str | int, ...]], tuple[str | int, ...]] = lambda loc: loc,
) -> str:
    """Every problem of a pydantic error, one per line, as ``path: message, got value``.

    ``relocate`` may rewrite a problem's location, e.g. to drop the tag pydantic
    inserts for a member of a tagged union.
    """
    lines = []
    for problem in error.errors():
        loc = relocate(tuple(problem["loc"]))
        message = _message(problem, loc)
        path = format_path(root, loc)
        line = f"{path}: {message}" if path else message  # a whole-document rule names its fields itself
        if (
            problem["type"] != "missing"
            and f"got {problem['input']!r}" not in message
            and not isinstance(problem["input"], dict)
        ):
            line += f", got {problem['input']!r}"  # (a whole section as "value" would bury the message)
        if problem["type"] == "string_type" and isinstance(problem["input"], (bool, int, float)):
            # ``cache_prefix: 2024`` is a number to YAML and JSON; the fix is not obvious from the type name
            kind = "boolean" if isinstance(problem["input"], bool) else "number"
            line += f" (a {kind}, not text: write it in quotes)"
        lines.append(line)
    return "\n".join(lines)


def _message(problem: ErrorDetails, loc: tuple[str | int, ...]) -> str:
    template = _MESSAGES.get(problem["type"])
    if template is not None:
        return template.format(**problem.get("ctx", {}))
    if problem["type"] == "value_error":  # our own validators' words, without pydantic's prefix
        message = str(problem["ctx"]["error"])
        field_prefix = f"{loc[-1]}: " if loc else ""
        return message.removeprefix(field_prefix) if field_prefix else message
    text = problem["msg"]
    return text[:1].lower() + text[1:]


def build_graph(
    document: Mapping[str, Any],
    registry: StageRegistry,
    resources: Resources | Mapping[str, Any] | None = None,
    *,
    root: str = "pipeline",
) -> Graph:
    """Validate ``document`` (the mapping found at ``root``) and build its graph.

    Raises :class:`~.errors.BuildError`, naming the place as a path under ``root``
    (``pipeline.stages[3].batch.max_items: ...``), when the document does not
    validate, a stage type is not in ``registry``, a stage's ``params`` do not
    validate, its factory raises BuildError, ValueError or TypeError (a missing
    resource among them), or the stages do not wire into a valid :class:`Graph`.
    Anything else a factory raises propagates as it is.
    """
    if not isinstance(resources, Resources):
        resources = Resources(resources)
    try:
        config = PipelineConfig.model_validate(document)
    except ValidationError as exc:
        raise BuildError(describe_validation_error(exc, root)) from None
    specs = [_build_stage(config, index, registry, resources, root) for index in range(len(config.stages))]
    try:
        return Graph(specs)
    except GraphError as exc:
        index = exc.index
        if index is None:
            index = next(i for i, s in enumerate(config.stages) if s.name == exc.stage)
        raise BuildError(f"{format_path(root, ('stages', index))}: {exc}") from None
    except BuildError as exc:
        raise BuildError(f"{root}: {exc}") from None


def _build_stage(
    config: PipelineConfig, index: int, registry: StageRegistry, resources: Resources, root: str
) -> StageSpec:
    stage_config = config.stages[index]
    where = format_path(root, ("stages", index))
    if stage_config.type not in registry:
        known = ", ".join(registry.names())
        raise BuildError(f"{where}.type: unknown stage type {stage_config.type!r} (known: {known})")
    stage_type = registry[stage_config.type]
    try:
        params = stage_type.params.model_validate(stage_config.params)
    except ValidationError as exc:
        raise BuildError(describe_validation_error(exc, f"{where}.params")) from None
    try:
        stage = stage_type.build(params, resources)
    except (BuildError, ValueError, TypeError) as exc:
        raise BuildError(f"{where} ({stage_config.name}): {exc}") from None
    stage.thread_limit = stage_config.threads
    batch = stage_config.batch
    return StageSpec(
        name=stage_config.name,
        stage=stage,
        after=tuple(stage_config.after),
        workers=stage_config.workers,
        capacity=stage_config.capacity,
        batch=None if batch is None else BatchPolicy(batch.max_items, batch.max_wait_ms / 1e3),
    )


_BOOL = "tag:yaml.org,2002:bool"


class ConfigLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, but a key given twice in one mapping is an error,
    and only ``true``/``false`` are booleans (YAML 1.2's rule).

    PyYAML keeps the last of two equal keys silently, so a second ``model:`` section
    would drop the first. And it reads YAML 1.1, where ``off``, ``on``, ``yes`` and
    ``no`` are booleans: ``integrity: off`` would reach the settings as ``False``, not
    the word they accept. Plain boolean settings still take those words (pydantic
    reads ``"off"`` as false); strict flags refuse them, as they do from JSON.
    """

    yaml_implicit_resolvers = {
        first: [(tag, pattern) for tag, pattern in resolvers if tag != _BOOL]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # ``<<: *defaults``: keys given beside it override the merged ones
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable):
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"found duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)


ConfigLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def load_yaml(source: str | Path) -> Any:
    """Parse a YAML file (a Path) or YAML text (a str); a one-line error if unreadable or malformed.

    Raises :class:`~.errors.BuildError`, naming the file (or ``YAML`` for text), when
    the file is missing, a folder, unreadable or not UTF-8, or the text is not valid
    YAML (a key given twice in one mapping included) or holds a value PyYAML cannot
    construct (a date such as ``2020-13-45``, ``!!int x``).
    """
    try:
        if isinstance(source, Path):
            with source.open(encoding="utf-8") as handle:
                return yaml.load(handle, ConfigLoader)
        return yaml.load(source, ConfigLoader)
    except FileNotFoundError:
        raise BuildError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise BuildError(f"{source}: is a folder, not a YAML file") from None
    except OSError as exc:
        raise BuildError(f"{source}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise BuildError(f"{source}: not valid YAML: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        where = source if isinstance(source, Path) else "YAML"
        raise BuildError(f"{where}: not valid YAML: {_yaml_problem(exc)}") from None
    except (ValueError, TypeError, AttributeError) as exc:  # a constructor failed on a scalar
        where = source if isinstance(source, Path) else "YAML"
        raise BuildError(
            f"{where}: not valid YAML: a value cannot be read ({' '.join(str(exc).split())})"
        ) from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's several-line message as one line: where, what, and while doing what."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem is None:
        return " ".join(str(error).split())
    mark = error.problem_mark
    where = "" if mark is None else f"line {mark.line + 1}, column {mark.column + 1}: "
    context = f" ({error.context})" if error.context else ""
    return f"{where}{error.problem}{context}"


def graph_from_yaml(
    source: str | Path,
    registry: StageRegistry,
    resources: Resources | Mapping[str, Any] | None = None,
    *,
    root: str = "pipeline",
) -> Graph:
    """Build the graph under key ``root`` of a YAML file or text.

    Raises :class:`~.errors.BuildError` when the source cannot be read or parsed
    (:func:`load_yaml`, which also says what escapes it), when the document is not
    a mapping with a mapping under ``root``, and whenever :func:`build_graph` does.
    """
    document = load_yaml(source)
    if not isinstance(document, Mapping) or root not in document:
        raise BuildError(f"{root}: is required (a mapping with a 'stages' list)")
    section = document[root]
    if not isinstance(section, Mapping):
        raise BuildError(f"{root}: must be a mapping with a 'stages' list, got {section!r}")
    return build_graph(section, registry, resources, root=root)
