"""Whether a TCP port accepts connections: the probe every check of a master, etcd or node uses.

A module of its own because both sides of the master's description need it and
neither may import the other for it: :mod:`.master` waits on the ports of what it
spawns (and imports :mod:`.master_address` for the cluster a master leads), while
:mod:`.master_address` asks whether a configured master or its coordinators listen.
"""

from __future__ import annotations

import socket


def is_listening(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True if ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
