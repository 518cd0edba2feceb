"""The layering the README promises: pipeline/ knows nothing above it; stages/ knows no vLLM, Mooncake or connector/.

Inside connector/ the rooms import downwards too: the store knows no vLLM connector,
command line or bench, and the vLLM connector knows no command line or bench.

Test and bench aids (:mod:`kvpipe.connector.store.mooncake.harness`: pausing a master,
reading an HA cluster's operation log) ship in the package, but no runtime module
imports them: only tests and the benches do.

Every import of every module is read from its source (``ast``), inside functions
and ``TYPE_CHECKING`` blocks too: a lazy import breaks the layering as much as a
top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
#: per folder, the module prefixes none of its files (at any depth) may import
FORBIDDEN = {
    "pipeline": ("kvpipe.stages", "kvpipe.connector", "vllm", "mooncake", "torch"),
    "stages": ("kvpipe.connector", "vllm", "mooncake"),
    "connector/store": (
        "kvpipe.connector.vllm",
        "kvpipe.connector.cli",
        "kvpipe.connector.bench",
        "kvpipe.connector.fleet",
        "vllm",
    ),
    "connector/vllm": ("kvpipe.connector.cli", "kvpipe.connector.bench", "kvpipe.connector.fleet"),
    # the fleet runs the connector in processes of its own (vLLM's event types it reads)
    "connector/fleet": ("kvpipe.connector.cli", "kvpipe.connector.vllm"),
}
#: the test and bench aids, and the folders of the one runtime room allowed them (the benches)
HARNESS = "kvpipe.connector.store.mooncake.harness"
HARNESS_USERS = ("connector/bench",)


def imported_modules(source: str, package: str, *, with_names: bool = False) -> list[str]:
    """The absolute names of the modules ``source`` imports; ``package`` is its own package's folder.

    (``"connector/store/mooncake"`` for ``kvpipe.connector.store.mooncake.client``.)
    ``with_names`` adds ``module.name`` for each name a ``from module import name`` takes,
    which may be a module itself (``from . import harness``).
    """
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                module = node.module or ""
            else:  # relative: from the package (level 1) or above it
                own = ["kvpipe", *package.split("/")]
                base = own[: max(0, len(own) + 1 - node.level)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            names.append(module)
            if with_names:
                names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


def violations(source: str, package: str, layer: str | None = None) -> list[str]:
    """The imports of ``source`` (a module in folder ``package``) that ``layer``'s rule forbids."""
    forbidden = FORBIDDEN[layer or package]
    return [
        name
        for name in imported_modules(source, package)
        if any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden)
    ]


@pytest.mark.parametrize("layer", list(FORBIDDEN))
def test_no_module_imports_above_its_layer(layer: str) -> None:
    found = {
        str(path.relative_to(ROOT)): bad
        for path in sorted((ROOT / layer).rglob("*.py"))
        if (bad := violations(path.read_text(), str(path.parent.relative_to(ROOT)), layer))
    }
    assert found == {}


@pytest.mark.parametrize(
    ("package", "source"),
    [
        ("pipeline", "from kvpipe.stages import SaveRequest"),
        ("pipeline", "from ..connector.store import Store"),
        ("pipeline", "def f():\n    import torch"),
        (
            "stages",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vllm.config import VllmConfig",
        ),
        ("stages", "from ..connector.store import configs"),
        ("stages", "import mooncake.store"),
        ("connector/store", "from ..vllm.settings import ConnectorSettings"),
        ("connector/vllm", "from ..bench.launch import make_llm"),
    ],
)
def test_the_check_finds_an_import_across_the_layers(package: str, source: str) -> None:
    assert violations(source, package)


def test_the_check_lets_stages_use_the_pipeline_and_its_own_modules() -> None:
    assert (
        violations("from kvpipe.pipeline import Stage\nfrom .model import KVCache\nimport torch", "stages")
        == []
    )


def test_the_check_resolves_relative_imports_from_a_nested_package() -> None:
    assert violations("from ...vllm import settings", "connector/store/mooncake", "connector/store") == [
        "kvpipe.connector.vllm"
    ]
    assert violations("from ..protocol import Store", "connector/store/mooncake", "connector/store") == []


def imports_harness(source: str, package: str) -> bool:
    """Whether ``source`` (a module in folder ``package``) imports the test and bench aids."""
    return any(
        name == HARNESS or name.startswith(HARNESS + ".")
        for name in imported_modules(source, package, with_names=True)
    )


def test_no_runtime_module_imports_the_test_and_bench_aids() -> None:
    harness = ROOT / Path(*HARNESS.split(".")[1:]).with_suffix(".py")
    assert harness.exists()  # the rule guards a module that is there
    runtime = [
        path
        for layer in ("pipeline", "stages", "connector")
        for path in sorted((ROOT / layer).rglob("*.py"))
        if path != harness and not any(path.is_relative_to(ROOT / folder) for folder in HARNESS_USERS)
    ]
    found = [
        str(path.relative_to(ROOT))
        for path in runtime
        if imports_harness(path.read_text(), str(path.parent.relative_to(ROOT)))
    ]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "from . import harness",
        "from .harness import pause",
        "import kvpipe.connector.store.mooncake.harness",
        "from kvpipe.connector.store.mooncake import MooncakeStore, harness",
        "def f():\n    from .harness import durable_puts",
    ],
)
def test_the_check_finds_an_import_of_the_aids(source: str) -> None:
    assert imports_harness(source, "connector/store/mooncake")


def test_the_check_lets_a_runtime_module_import_its_neighbours() -> None:
    assert not imports_harness(
        "from . import master\nfrom .cluster import LocalCluster", "connector/store/mooncake"
    )
