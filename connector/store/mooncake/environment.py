"""The settings Mooncake's native client reads from the environment, and nowhere else.

``setup()`` takes no parameter for these (its signature, mooncake 0.3.13: host, metadata,
sizes, protocol, devices, master, SSD offload, tenant), so :func:`native_environment` is
the one place kvpipe writes them:

- ``MC_RPC_TIMEOUT_MS``, the deadline of every master RPC (Mooncake's default, 30 s, is
  what a stopped master costs each call), read once, in ``setup()``: set around the call,
  then as it was, since processes started later (an engine's workers) inherit the
  environment and would take it for the user's;
- ``MC_TCP_PROGRESS_TIMEOUT_SEC``, how long a TCP transfer may make no progress (a node cut
  off by the network costs a get or a put that long: 30 s by default), read at each
  transfer, not at set-up: so it stays set for the rest of the process (the last store
  opened wins; processes started later inherit it);
- the disk tier's variables (:meth:`~.settings.DiskTier.mooncake_environment`), read once,
  in ``setup()``: set around the call, then as they were.

A deadline the user exported (in the environment as the first store found it:
:meth:`~.registry.ProcessRegistry.user_environment`) is theirs and wins.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from .registry import REGISTRY
from .settings import MooncakeSettings

RPC_TIMEOUT_ENV = "MC_RPC_TIMEOUT_MS"
TRANSFER_TIMEOUT_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"


@contextmanager
def native_environment(settings: MooncakeSettings) -> Iterator[None]:
    """The environment ``setup()`` must read for ``settings`` (see the module docstring), within it.

    On leaving, every variable is as it was but the transfer deadline, which the
    transport reads later. A variable the user exported for the disk tier is set
    aside during the call only (the disk settings decide the tier).
    """
    user = REGISTRY.user_environment()
    if TRANSFER_TIMEOUT_ENV not in user:
        os.environ[TRANSFER_TIMEOUT_ENV] = str(settings.transfer_timeout_s)
    during = {} if RPC_TIMEOUT_ENV in user else {RPC_TIMEOUT_ENV: str(settings.rpc_timeout_ms)}
    if settings.disk is not None:
        during.update(settings.disk.mooncake_environment())
    previous = {name: os.environ.get(name) for name in during}
    os.environ.update(during)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def rpc_timeout_ms(settings: MooncakeSettings) -> int:
    """The RPC deadline the client is set up with: the user's ``MC_RPC_TIMEOUT_MS`` or ``settings``'."""
    try:
        return max(1, int(REGISTRY.user_environment()[RPC_TIMEOUT_ENV]))
    except (KeyError, ValueError):
        return settings.rpc_timeout_ms
