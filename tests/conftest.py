"""Settings every test shares."""

from collections.abc import Iterator

import pytest
import structlog

from kvpipe.connector.store.mooncake.cluster import LocalCluster


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """The command line configures structlog globally; no test inherits another's set-up."""
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """etcd and two HA masters for the whole session (tests/connector and tests/connector/vllm): Mooncake's
    client joins one etcd per process. Tests add the store nodes they need and stop them."""
    with LocalCluster(masters=2) as running:
        yield running
