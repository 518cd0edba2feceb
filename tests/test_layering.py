"""The layering the README promises: pipeline/ knows nothing above it; stages/ knows no vLLM, Mooncake or connector/.

Every import of every module is read from its source (``ast``), inside functions
and ``TYPE_CHECKING`` blocks too: a lazy import breaks the layering as much as a
top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
#: per package folder, the module prefixes none of its files may import
FORBIDDEN = {
    "pipeline": ("kvpipe.stages", "kvpipe.connector", "vllm", "mooncake", "torch"),
    "stages": ("kvpipe.connector", "vllm", "mooncake"),
}


def imported_modules(source: str, package: str) -> list[str]:
    """The absolute names of the modules ``source`` (a module of ``kvpipe.<package>``) imports."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names.append(node.module or "")
            else:  # relative: from the package (level 1) or above it
                base = ["kvpipe", package][: max(0, 3 - node.level)]
                names.append(".".join([*base, *([node.module] if node.module else [])]))
    return names


def violations(source: str, package: str) -> list[str]:
    return [
        name
        for name in imported_modules(source, package)
        if any(name == prefix or name.startswith(prefix + ".") for prefix in FORBIDDEN[package])
    ]


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_no_module_imports_above_its_layer(package: str) -> None:
    found = {
        str(path.relative_to(ROOT)): bad
        for path in sorted((ROOT / package).rglob("*.py"))
        if (bad := violations(path.read_text(), package))
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
        ("stages", "from ..connector import stores"),
        ("stages", "import mooncake.store"),
    ],
)
def test_the_check_finds_an_import_across_the_layers(package: str, source: str) -> None:
    assert violations(source, package)


def test_the_check_lets_stages_use_the_pipeline_and_its_own_modules() -> None:
    assert (
        violations("from kvpipe.pipeline import Stage\nfrom .model import KVCache\nimport torch", "stages")
        == []
    )
