"""A store client in its own process that only lends its segment: where remote puts land.

    python -m kvpipe.connector.bench.peer MASTER METADATA SEGMENT_BYTES

It mounts ``SEGMENT_BYTES`` on the given master, prints ``READY`` and holds the
segment until its stdin closes (the parent exiting closes it too, so a crashed
benchmark leaves no peer behind).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore

READY = "READY"


def main() -> None:
    master, metadata, segment = sys.argv[1], sys.argv[2], int(sys.argv[3])
    settings = MooncakeSettings(
        master=master, metadata_server=metadata, global_segment_size=segment, local_buffer_size=0
    )
    with MooncakeStore.open(settings):
        print(READY, flush=True)
        sys.stdin.read()


def start_ready_child(module: str, *args: str, what: str) -> subprocess.Popen[str]:
    """``python -m module *args``, its stdin and stdout piped, once it printed :data:`READY`.

    :raises RuntimeError: it ended or printed anything else first (``what`` names it); it is reaped.
    """
    child = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert child.stdout is not None
    if child.stdout.readline().strip() != READY:
        child.kill()
        raise RuntimeError(f"{what} did not start (exit code {child.wait()})")
    return child


@contextmanager
def remote_segment(master: str, metadata: str, segment_bytes: int) -> Iterator[subprocess.Popen[str]]:
    """Run a peer holding ``segment_bytes`` on ``master`` for the block; yields its process.

    (Fault tests kill it mid-run; a peer already dead is only reaped on the way out.)
    """
    peer = start_ready_child(__name__, master, metadata, str(segment_bytes), what="the peer store client")
    try:
        yield peer
    finally:
        if peer.poll() is None and peer.stdin is not None:
            peer.stdin.close()
        try:
            peer.wait(timeout=15)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()


if __name__ == "__main__":
    main()
