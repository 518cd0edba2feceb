"""The connector's settings have one documentation: their fields' descriptions, which the docs page's table is."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.connector.vllm.settings import ConnectorSettings, markdown_table

PAGE = Path(__file__).parents[3] / "docs" / "vllm-connector.md"


@pytest.mark.parametrize("name", list(ConnectorSettings.model_fields))
def test_every_setting_says_what_it_sets(name: str) -> None:
    description = ConnectorSettings.model_fields[name].description
    assert description and "|" not in description, "a description is a cell of the docs table"


def test_the_docs_settings_table_is_the_fields() -> None:
    lines = PAGE.read_text().splitlines(keepends=True)
    start = lines.index(markdown_table().splitlines(keepends=True)[0])
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    assert "".join(lines[start:end]) == markdown_table(), "python -m kvpipe.connector.vllm.settings prints it"
