"""What a process guards is stopped when it exits, unless it stopped it itself; a fork stops nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

OWNER = """
import os
import sys
from pathlib import Path

from kvpipe.connector import exit_guard

log = Path(sys.argv[1])

def stopper(name):
    return lambda: log.open("a").write(f"{name} stopped by {os.getpid()}\\n")

def failing():
    raise RuntimeError("this child would not stop")

exit_guard.guard("first", stopper("first"))
exit_guard.guard("second", stopper("second"))
exit_guard.guard("failing", failing)  # the newest: stopped first, and it raises
exit_guard.guard("released", stopper("released"))
exit_guard.release("released")
if (child := os.fork()) == 0:
    sys.exit(0)  # runs the exit hooks too
os.waitpid(child, 0)
print(os.getpid(), exit_guard.guarded(), flush=True)
"""


def run_owner(tmp_path: Path) -> tuple[str, list[str]]:
    log = tmp_path / "stopped.log"
    owner = subprocess.run(
        [sys.executable, "-c", OWNER, str(log)], capture_output=True, text=True, timeout=60, check=True
    )
    pid, guarded = owner.stdout.split()
    assert guarded == "3"
    assert "this child would not stop" in owner.stderr  # raised, once the others were stopped
    return pid, log.read_text().splitlines() if log.exists() else []


def test_what_an_owner_guards_and_never_releases_is_stopped_at_its_exit_newest_first_though_one_raises(
    tmp_path: Path,
) -> None:
    pid, stopped = run_owner(tmp_path)
    assert stopped == [f"second stopped by {pid}", f"first stopped by {pid}"]


def test_a_released_guard_and_a_forked_childs_exit_stop_nothing(tmp_path: Path) -> None:
    pid, stopped = run_owner(tmp_path)
    assert all(line.endswith(f"by {pid}") and not line.startswith("released") for line in stopped)
