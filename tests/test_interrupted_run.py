"""A test run stopped by SIGTERM stops every process its tests started."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.mooncake

CHECKOUT = Path(__file__).resolve().parents[1]  # where ``tests.conftest`` imports from

HOLDER = """
import time
from pathlib import Path

from kvpipe.connector.store.mooncake.master import LocalMaster


def test_holds_a_master() -> None:
    with LocalMaster() as master:
        Path({pid_file!r}).write_text(str(master.pid))
        time.sleep(120)
"""


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_run_stopped_by_sigterm_stops_the_master_a_test_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "master.pid"
    (tmp_path / "test_holder.py").write_text(HOLDER.format(pid_file=str(pid_file)))
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         str(tmp_path / "test_holder.py")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(CHECKOUT)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
            time.sleep(0.1)
        master = int(pid_file.read_text())
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == pytest.ExitCode.INTERRUPTED, output
    assert not running(master)
