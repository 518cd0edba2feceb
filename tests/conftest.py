"""Settings every test shares."""

import signal
from collections.abc import Iterator
from types import FrameType

import pytest
import structlog

from kvpipe.connector.store.mooncake.cluster import LocalCluster


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a CI timeout, ``kill``) interrupts the run as Ctrl-C does.

    Python's default dies on the spot and leaves every master, cluster and engine the
    running tests started behind; interrupted, the tests' context managers and the
    fixtures unwind and stop them (tests/test_interrupted_run.py).
    """
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


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
