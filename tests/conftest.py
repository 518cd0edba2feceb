"""Settings every test shares."""

import signal
from collections.abc import Iterator
from types import FrameType

import psutil
import pytest
import structlog

from kvpipe.connector.store.mooncake.cluster import LocalCluster
from kvpipe.connector.store.mooncake.master import LocalMaster


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


def _running(master: LocalMaster) -> bool:
    """Whether ``master``'s process runs (started, and neither killed nor exited)."""
    try:
        return master.pid is not None and psutil.Process(master.pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


#: how long a cluster whose leader a test killed may take to elect the standby (Mooncake's lease
#: wait, ~5 s, and the election, stretched on a busy machine)
ELECTION_S = 60.0


@pytest.fixture(scope="session")
def _session_cluster() -> Iterator[LocalCluster]:
    """etcd and two HA masters for the whole session: Mooncake's client joins one etcd per process."""
    with LocalCluster(masters=2) as running:
        yield running


@pytest.fixture
def cluster(_session_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The session's cluster (tests/connector and tests/connector/vllm), checked whole after each test.

    Tests add the store nodes they need and stop them; a test that kills the leader starts
    it again as a standby. What the next test may count on is checked here, so a test that
    leaves the cluster otherwise fails itself (at teardown), never a later test: every
    master runs, one of them leads and serves, and no store node is left.
    """
    yield _session_cluster
    assert all(map(_running, _session_cluster.masters)), "a master of the session's cluster is not running"
    _session_cluster.wait_for_leader(ELECTION_S)
    assert _session_cluster.store_nodes == [], "store nodes left on the session's cluster"
