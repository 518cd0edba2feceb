"""Children that do not outlive their owner: what a process started is stopped when it exits.

A script or a test that starts a master, an etcd, a store node or a fleet's
``vllm serve`` and router without stopping them (no ``with``, an error between
a start and its stop) would leave them running after it exits, holding their
ports, their memory and, for an engine, a core. Every such starter guards its
child here and releases the guard when it stops the child itself; whatever is
still guarded when the interpreter exits (normally, on an unhandled exception,
on a SIGTERM turned into an unwind) is stopped then, newest first, as nested
``with`` blocks would. Only SIGKILL of the owner escapes this.

A forked child (an engine's worker) inherits the table: each guard remembers
the pid that took it, and a process stops only its own children.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Hashable

#: the guarded children: by the starter's key, how to stop each and the pid that started it
_GUARDED: dict[Hashable, tuple[Callable[[], None], int]] = {}


def guard(key: Hashable, stop: Callable[[], None]) -> None:
    """Call ``stop`` when this interpreter exits, unless :func:`release` of ``key`` comes first."""
    _GUARDED[key] = (stop, os.getpid())


def release(key: Hashable) -> None:
    """The child guarded under ``key`` was stopped by its owner (or never started): forget it."""
    _GUARDED.pop(key, None)


def guarded() -> int:
    """How many children this process guards now."""
    owner = os.getpid()
    return sum(1 for _, started_by in _GUARDED.values() if started_by == owner)


@atexit.register
def _stop_the_guarded() -> None:
    """Every stop runs though one before it raised (a group that survived SIGKILL must not
    leave the older children running); the first error is raised after them, for atexit to print."""
    owner = os.getpid()
    first_error: Exception | None = None
    for key, (stop, started_by) in reversed(list(_GUARDED.items())):
        if started_by == owner:
            _GUARDED.pop(key, None)
            try:
                stop()
            except Exception as error:  # noqa: BLE001 - raised below, once every child was stopped
                first_error = first_error or error
    if first_error is not None:
        raise first_error
