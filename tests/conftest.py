"""Settings every test shares."""

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """The command line configures structlog globally; no test inherits another's set-up."""
    yield
    structlog.reset_defaults()
