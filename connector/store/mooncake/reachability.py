"""Whether a client could be set up now: a master that serves, and a metadata server that listens.

With no master serving, the client's ``setup()`` retries for ~90 s before it fails; a
serving engineer deserves a one-line error within ``connect_timeout_s`` instead.
"""

from __future__ import annotations

import time

from .master import MasterError, wait_until_listening
from .master_address import MasterAddress
from .settings import http_endpoint


def check_reachable(address: MasterAddress, metadata_server: str, timeout_s: float) -> None:
    """Return once a master serves at ``address`` and an HTTP ``metadata_server`` listens.

    In HA, a leader must be recorded and listening: a cluster whose masters are
    all standing by (or gone) would make ``setup()`` retry for ~90 s.

    :raises MasterError: not so within ``timeout_s`` (one line naming what is missing).
    """
    if address.kind == "direct":
        wait_until_listening(*address.endpoints[0], timeout_s=timeout_s, what="mooncake master")
    else:
        deadline = time.monotonic() + timeout_s
        while not address.serving(timeout_s=min(0.5, timeout_s)):
            if time.monotonic() >= deadline:
                what = (
                    "no etcd endpoint listens"
                    if not address.coordinators_listening(0.5)
                    else "no master leads"
                )
                raise MasterError(
                    f"mooncake cluster at {address.text} is not reachable: {what} (waited {timeout_s:g} s)"
                )
            time.sleep(0.05)
    if (http := http_endpoint(metadata_server)) is not None:
        wait_until_listening(*http, timeout_s=timeout_s, what="mooncake metadata server")
