"""A process group its owner never stopped is stopped whole when the owner exits."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

OWNER = """
import os
import sys
import time
from pathlib import Path

from kvpipe.connector.fleet.processes import GroupProcess

# a leader and a child of its own, as vllm serve and its engine core are
group = GroupProcess("sleepers", ["sh", "-c", "sleep 300 & sleep 300"], Path(sys.argv[1]), dict(os.environ))
group.start()  # never stopped
while len(group.survivors()) < 3:
    time.sleep(0.05)
    group.track()
print(" ".join(str(process.pid) for process in group.survivors()), flush=True)
"""


def test_a_group_its_owner_never_stopped_is_stopped_whole_when_the_owner_exits(tmp_path: Path) -> None:
    owner = subprocess.run(
        [sys.executable, "-c", OWNER, str(tmp_path / "group.log")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    pids = [int(pid) for pid in owner.stdout.split()]
    assert len(pids) == 3  # sh and its two sleeps
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in pids if psutil.pid_exists(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)  # reaped by init once orphaned: a zombie may linger a moment
    assert not [pid for pid in alive if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
