"""The admin HTTP of a master running on this machine, read off its own command line.

A master's RPC address is what users have (``kvpipe store`` and every engine config
print it); its admin HTTP (``--metrics_port``, where the keys are listed) is a port of
the starter's choosing, 9003 only by default, and ``kvpipe store``, ``kvpipe fleet``
and ``master: spawn`` pick free ones. Where the master runs on this machine its flags
say which: :func:`local_master_admin` finds the ``mooncake_master`` process serving an
RPC port and reads its ``--metrics_port`` (and ``--metrics_host``), so ``kvpipe
inspect`` needs no ``--metrics`` for a master beside it; :func:`local_master_metadata`
reads its metadata server the same way (``--verify`` needs no ``--metadata-server``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import psutil

#: mooncake_master's own defaults (gflags), for flags a command line leaves out
DEFAULT_RPC_PORT = 50051
DEFAULT_METRICS_PORT = 9003
DEFAULT_HTTP_METADATA_PORT = 8080
MASTER_PROGRAM = "mooncake_master"

__all__ = ["local_master_admin", "local_master_metadata", "master_flags"]

_Found = TypeVar("_Found")


def master_flags(cmdline: Sequence[str]) -> dict[str, str]:
    """The ``--name=value`` and ``--name value`` flags of a gflags command line, by name."""
    flags: dict[str, str] = {}
    for i, arg in enumerate(cmdline):
        if not arg.startswith("--"):
            continue
        name, equals, value = arg[2:].partition("=")
        if not equals and i + 1 < len(cmdline) and not cmdline[i + 1].startswith("--"):
            value = cmdline[i + 1]
        flags[name] = value
    return flags


def _serves(flags: dict[str, str], host: str, port: int) -> bool:
    """Whether a master of these flags serves RPC at ``host:port``."""
    try:
        rpc_port = int(flags.get("rpc_port") or flags.get("port") or DEFAULT_RPC_PORT)
    except ValueError:
        return False
    rpc_host = flags.get("rpc_address") or "0.0.0.0"  # noqa: S104 - how the master reads an absent flag
    return rpc_port == port and _same_host(rpc_host, host)


def _admin_of(cmdline: Sequence[str], host: str, port: int) -> tuple[str, int] | None:
    """Where this master command line's admin HTTP is, if it serves RPC at ``host:port``; else None."""
    flags = master_flags(cmdline)
    if not _serves(flags, host, port):
        return None
    try:
        metrics_port = int(flags.get("metrics_port") or DEFAULT_METRICS_PORT)
    except ValueError:
        return None
    metrics_host = flags.get("metrics_host") or "0.0.0.0"  # noqa: S104 - as above
    return (host if _any_address(metrics_host) else metrics_host), metrics_port


def _metadata_of(cmdline: Sequence[str], host: str, port: int) -> str | None:
    """The metadata server clients of this master command line use, if it serves RPC at ``host:port``."""
    flags = master_flags(cmdline)
    if not _serves(flags, host, port):
        return None
    if flags.get("enable_http_metadata_server", "false").lower() not in ("true", "1"):
        return "P2PHANDSHAKE"
    metadata_port = flags.get("http_metadata_server_port") or DEFAULT_HTTP_METADATA_PORT
    return f"http://{host}:{metadata_port}/metadata"


def _any_address(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")  # noqa: S104 - compared, not bound


def _same_host(bound: str, asked: str) -> bool:
    """Whether a master bound to ``bound`` answers at ``asked`` (one of this machine's addresses)."""
    return _any_address(bound) or bound == asked or {bound, asked} <= {"127.0.0.1", "localhost", "::1"}


def _is_this_machine(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) is one of this machine's."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: not resolved here (a probe must stay bounded)
    if address.is_loopback:
        return True
    return any(host == entry.address for entries in psutil.net_if_addrs().values() for entry in entries)


def _master_cmdlines() -> Iterable[list[str]]:
    for process in psutil.process_iter(["name", "cmdline"]):
        cmdline = process.info.get("cmdline") or []
        name = process.info.get("name") or ""
        if name == MASTER_PROGRAM or (cmdline and cmdline[0].rsplit("/", 1)[-1] == MASTER_PROGRAM):
            yield cmdline


def local_master_admin(host: str, port: int) -> tuple[str, int] | None:
    """The admin HTTP (host, port) of the ``mooncake_master`` on this machine serving RPC at ``host:port``.

    None when ``host`` is not this machine's, or no such process runs (or it cannot be read).
    """
    return _first_local(_admin_of, host, port)


def local_master_metadata(host: str, port: int) -> str | None:
    """The metadata server of the ``mooncake_master`` on this machine serving RPC at ``host:port``.

    ``P2PHANDSHAKE`` unless its flags enable the HTTP metadata server; None as :func:`local_master_admin`.
    """
    return _first_local(_metadata_of, host, port)


def _first_local(read: Callable[[Sequence[str], str, int], _Found | None], host: str, port: int) -> _Found | None:
    """``read`` of the first master command line on this machine it knows for ``host:port``; None if none."""
    if not _is_this_machine(host):
        return None
    for cmdline in _master_cmdlines():
        if (found := read(cmdline, host, port)) is not None:
            return found
    return None
