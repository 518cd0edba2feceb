"""The docs say what the code does, where a command can tell: links, series, flags, config keys.

Each check reads every page (:func:`~.pages.pages`: README.md, BENCHMARKS.md, docs/**)
against the code's own lists: the metrics catalogue (connector/vllm/metrics.py), the
``kvpipe`` parser (connector/cli), the bench's workloads, the settings classes (a
``kvpipe run`` config's, the connector's ``kv_connector_extra_config``). What a check
finds is listed as ``page:line: what``, so a failure says where to look.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvpipe.connector.bench import WORKLOADS
from kvpipe.connector.cli.main import parser
from kvpipe.connector.run import config_doc
from kvpipe.connector.vllm.metrics import BY_NAME, CATALOGUE, Kind, Metric
from kvpipe.connector.vllm.settings import VLLM_ONLY_KEYS, ConnectorSettings

from .pages import ROOT, Page, Span, pages

PATHS = pages()
PAGES = [Page(path) for path in PATHS]
ids = [page.name for page in PAGES]
each_page = pytest.mark.parametrize("page", PAGES, ids=ids)

#: labels vLLM's logger adds to every series the connector registers
VLLM_LABELS = {"model_name", "engine"}
#: the sections of a ``kvpipe run`` config whose keys a dotted path may name
SECTIONS = ("store", "model", "parallel", "workload", "save")
#: the first header of a table that lists the report's fields (``store.group_semantics`` is one), not config keys
REPORT_TABLE = "field"


# -- links ----------------------------------------------------------------------------------


def _relative_links(page: Page) -> Iterator[tuple[int, Path, str]]:
    """(line, the file or folder it names, its anchor) per link that is no URL."""
    for line, target in page.links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        yield line, (page.path.parent / path).resolve() if path else page.path, anchor


@each_page
def test_every_relative_link_reaches_a_file_of_the_repository(page: Page) -> None:
    broken = [
        f"{page.name}:{line}: {target}"
        for line, target, _ in _relative_links(page)
        if not target.exists() or not target.is_relative_to(ROOT)
    ]
    assert broken == []


@each_page
def test_every_anchor_a_link_names_is_a_heading_of_its_page(page: Page) -> None:
    missing = []
    for line, target, anchor in _relative_links(page):
        if anchor and target.suffix == ".md" and target.exists() and anchor not in Page(target).anchors:
            missing.append(f"{page.name}:{line}: {target.relative_to(ROOT)}#{anchor}")
    assert missing == []


def test_every_page_is_reachable_from_the_readme_through_the_index() -> None:
    """No page of docs/ is an orphan: the README links docs/README.md, which links the rest."""
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = Page(todo.pop())
        seen.add(page.path)
        todo += [
            target
            for _, target, _ in _relative_links(page)
            if target.suffix == ".md" and target.exists() and target not in seen and target in PATHS
        ]
    assert sorted(str(path.relative_to(ROOT)) for path in set(PATHS) - seen) == []


def test_a_heading_slug_is_githubs() -> None:
    page = Page(ROOT / "docs" / "architecture.md")
    assert "when-the-store-misbehaves" in page.anchors
    assert {"jobs-done-and-released", "sharing-the-engines-cores"} <= page.anchors


# -- the metrics catalogue --------------------------------------------------------------------

_SERIES = re.compile(r"kvpipe:([a-z_]+)(?:\{([^}\n]*)\})?")


def _series_names() -> dict[str, Metric]:
    names = {metric.series: metric for metric in CATALOGUE}
    for metric in CATALOGUE:
        if metric.kind is Kind.HISTOGRAM:
            names.update({f"{metric.series}{suffix}": metric for suffix in ("_bucket", "_count", "_sum")})
    return names


def _series_on(page: Page) -> Iterator[tuple[int, str, str | None]]:
    for number, line in enumerate(page.text.splitlines(), 1):
        for match in _SERIES.finditer(line):
            yield number, f"kvpipe:{match.group(1)}", match.group(2)


@each_page
def test_every_kvpipe_series_a_page_names_is_in_the_catalogue(page: Page) -> None:
    names = _series_names()
    unknown = [f"{page.name}:{line}: {series}" for line, series, _ in _series_on(page) if series not in names]
    assert unknown == [], "python -m kvpipe.connector.vllm.metrics lists the series"


@each_page
def test_every_label_a_page_gives_a_series_is_one_of_its_labels_and_values(page: Page) -> None:
    names = _series_names()
    wrong = []
    for line, series, selector in _series_on(page):
        metric = names.get(series)
        if metric is None or not selector:
            continue
        labels = {label.name: label.values for label in metric.labels}
        for matcher in selector.split(","):
            name, _, value = (part.strip() for part in matcher.strip().partition("="))
            allowed = labels.get(name, ())
            if (
                name not in labels
                and name not in VLLM_LABELS
                and not (name == "le" and series.endswith("_bucket"))
            ):
                wrong.append(f"{page.name}:{line}: {series} has no label {name!r} (it has {sorted(labels)})")
            elif value.startswith('"') and allowed and value.strip('"') not in allowed:
                wrong.append(f"{page.name}:{line}: {series}{{{name}}} is one of {allowed}, not {value}")
    assert wrong == []


@each_page
def test_no_page_names_a_series_by_its_stats_key_alone(page: Page) -> None:
    """``chunks_verified`` or ``handoffs{outcome="x"}`` in code is no series a reader finds in /metrics."""
    short = [
        f"{page.name}:{span.line}: `{span.text}` is {BY_NAME[match.group(1)].series}"
        for span in page.spans
        if (match := re.fullmatch(r"([a-z_]+)(\{.*\})?", span.text)) and match.group(1) in BY_NAME
    ]
    assert short == []


# -- the command line -------------------------------------------------------------------------

_COMMAND = re.compile(r"(?:^|[\s;(&|`$])(?:\.venv/bin/)?kvpipe(?:\s+-v+)?\s+(\w+)\b(.*)")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


def _commands(page: Page) -> Iterator[tuple[int, str, str]]:
    """(line, command, the rest) per ``kvpipe COMMAND ...`` in a code block or a code span.

    In a block, a line ending in ``\\`` or followed by an indented one that starts with
    ``[`` or ``-`` is continued there (a command wrapped over lines, a usage synopsis);
    a ``#`` comment or a backtick ends a command.
    """
    for block in page.blocks:
        if block.info in ("python", "yaml", "json"):
            continue
        joined: list[tuple[int, str]] = []
        for offset, line in enumerate(block.text.splitlines()):
            wrapped = line[:1].isspace() and line.strip().startswith(("[", "-"))
            if joined and (wrapped or joined[-1][1].endswith("\\")):
                joined[-1] = (joined[-1][0], joined[-1][1].rstrip("\\") + " " + line.strip())
            else:
                joined.append((block.line + offset, line))
        for number, line in joined:
            for match in _COMMAND.finditer(line.split(" #")[0]):
                yield number, match.group(1), match.group(2).split("`")[0]
    for span in page.spans:
        for match in _COMMAND.finditer(span.text):
            yield span.line, match.group(1), match.group(2)


@each_page
def test_every_kvpipe_flag_a_page_names_is_in_the_parser(page: Page) -> None:
    commands = _subparsers()
    wrong = []
    for line, command, rest in _commands(page):
        if command not in commands:  # "kvpipe hooks", a log event's name: no command line
            continue
        known = commands[command]._option_string_actions
        wrong += [
            f"{page.name}:{line}: kvpipe {command} has no {flag}"
            for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", rest)
            if flag not in known
        ]
    assert wrong == []


@each_page
def test_every_bench_workload_a_page_names_exists(page: Page) -> None:
    """``kvpipe bench tcp small-requests --json``: the words before the first flag are workloads."""
    unknown = []
    for line, command, rest in _commands(page):
        if command != "bench":
            continue
        for word in rest.split():
            if word.startswith("-") or not re.fullmatch(r"[a-z][a-z-]*", word):
                break
            if word not in WORKLOADS:
                unknown.append(f"{page.name}:{line}: kvpipe bench {word}")
    assert unknown == [], f"the workloads: {', '.join(WORKLOADS)}"


# -- config keys ------------------------------------------------------------------------------

KEYS = config_doc.section_fields()
_DOTTED = re.compile(
    rf"(?<![\w./:$-])({'|'.join(SECTIONS)})((?:\.[a-z_][a-z0-9_]*(?:\[\d*\])?)+)(?![\w/(-]|\.[a-z])"
)


def config_key_problem(path: list[str]) -> str | None:
    """Why the dotted ``path`` (``["store", "cluster", "masters"]``) names no config key, or None."""
    section = ""
    for depth, key in enumerate(path):
        key = re.sub(r"\[\d*\]$", "", key)
        if section not in KEYS:  # below a value: only a free-form one (pipeline: {...}) takes keys
            return None if section == "pipeline" else f"{section} holds a value, not {key!r}"
        if key not in KEYS[section]:
            return f"{section or 'a config'} has no key {key!r} (it has {', '.join(sorted(KEYS[section]))})"
        section = f"{section}.{key}" if section else key
        if f"{section}[]" in KEYS and depth + 1 < len(path):
            section += "[]"
    return None


def _dotted_keys(page: Page) -> Iterator[tuple[int, str]]:
    texts = [(span.line, span.text) for span in page.spans if span.table_header != REPORT_TABLE]
    texts += [(block.line, block.text) for block in page.blocks if block.info != "python"]
    for line, text in texts:
        for match in _DOTTED.finditer(text):
            if not re.search(r"\.(py|md|yaml|json|png)$", match.group(0)):
                yield line, match.group(0)


@each_page
def test_every_dotted_config_key_a_page_names_exists(page: Page) -> None:
    wrong = [
        f"{page.name}:{line}: {key}: {problem}"
        for line, key in _dotted_keys(page)
        if (problem := config_key_problem(key.split("."))) is not None
    ]
    assert wrong == []


def _keys_of(document: object, path: list[str]) -> Iterator[list[str]]:
    """Every key path of a parsed YAML or JSON document (list items add ``[]`` to their key)."""
    if isinstance(document, dict):
        for key, value in document.items():
            yield [*path, str(key)]
            yield from _keys_of(value, [*path, str(key)])
    elif isinstance(document, list) and path:
        for item in document:
            yield from _keys_of(item, [*path[:-1], f"{path[-1]}[]"])


@each_page
def test_every_key_of_a_config_in_a_yaml_block_exists(page: Page) -> None:
    wrong = []
    for block in page.blocks:
        if block.info != "yaml":
            continue
        document = yaml.safe_load(block.text)
        if not isinstance(document, dict) or not set(document) <= {*SECTIONS, "pipeline"}:
            continue  # not a kvpipe config
        for path in _keys_of(document, []):
            if (problem := config_key_problem(path)) is not None:
                wrong.append(f"{page.name}:{block.line}: {'.'.join(path)}: {problem}")
    assert wrong == []


_TRANSFER_CONFIG = re.compile(r"--kv-transfer-config\s+'([^']*)'")


@each_page
def test_every_key_of_a_kv_transfer_config_a_page_gives_exists(page: Page) -> None:
    """``vllm serve ... --kv-transfer-config '{...}'``: its extra config is kvpipe's settings."""
    connector_keys = set(ConnectorSettings.model_fields) | set(VLLM_ONLY_KEYS)
    wrong = []
    for block in page.blocks:
        for match in _TRANSFER_CONFIG.finditer(block.text):
            if "..." in match.group(1):
                continue  # an abridged one ("the same, ...")
            extra = json.loads(match.group(1)).get("kv_connector_extra_config", {})
            wrong += [f"{page.name}:{block.line}: {key}" for key in extra if key not in connector_keys]
            for path in _keys_of(extra.get("store") or {}, ["store"]):
                if (problem := config_key_problem(path)) is not None:
                    wrong.append(f"{page.name}:{block.line}: {'.'.join(path)}: {problem}")
    assert wrong == []


@each_page
def test_every_key_a_settings_table_lists_exists(page: Page) -> None:
    """A table headed ``key`` lists settings: the connector's, or a config's dotted keys."""
    wrong = []
    for span in page.spans:
        if span.table_header != "key" or not _first_cell(page, span):
            continue
        key = span.text
        if key not in ConnectorSettings.model_fields and config_key_problem(key.split(".")) is not None:
            wrong.append(f"{page.name}:{span.line}: {key}")
    assert wrong == []


def _first_cell(page: Page, span: Span) -> bool:
    """Whether ``span`` is its table row's first cell, the key (not a word of its description)."""
    row = page.text.splitlines()[span.line - 1].strip().strip("|")
    return row.split("|")[0].strip() == f"`{span.text}`"


def test_the_configuration_page_holds_the_tables_of_the_settings_classes() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    start = page.index(config_doc.BEGIN)
    end = page.index(config_doc.END) + len(config_doc.END) + 1
    assert page[start:end] == config_doc.markdown_tables(), (
        "run: .venv/bin/python -m kvpipe.connector.run.config_doc docs/configuration.md"
    )
