"""A network of our own: each replica and store node in a network namespace, joined by a bridge.

On loopback a "partition" cannot be made: every process shares one interface. Here
each host is a Linux network namespace with its own address on a veth pair whose
other end is on a bridge in the root namespace, where the master and the router
run on the bridge's address; Mooncake's transfers then cross real interfaces, and
taking a host's link down (:meth:`Network.cut`) partitions it from everything else
(this kernel has no ``netem`` for latency, so a partition is all there is).

Addresses come from 198.18.0.0/15, the range reserved for network tests (RFC 2544),
one /24 per network, picked at random so two networks rarely meet. Needs root and
iproute2's ``ip``; :func:`why_unavailable` probes once whether this machine can make a
namespace, and :class:`NetworkUnavailable` carries its reason. Once the probe has passed,
an ``ip`` command that fails is an error of ours (:class:`NetworkError`), never a
machine that cannot. Leaving the ``with`` block deletes every namespace, link and
bridge it made (a namespace's processes must have been stopped first: the fleet stops
them before).
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from typing import Self

#: 198.18.0.0/15: reserved for benchmark and network tests, used by nothing else
TEST_RANGE = "198.18"
PREFIX_LEN = 24


class NetworkUnavailable(RuntimeError):
    """This machine cannot make network namespaces (no ``ip``, not root, or a kernel without them or
    refusing them); the message says which (:func:`why_unavailable`)."""


class NetworkError(RuntimeError):
    """An ``ip`` command of ours failed on a machine that can make namespaces: a bug or a clash to look into."""


#: ``ip netns add``'s stderr when the kernel refuses this process a namespace (EPERM/EACCES: no
#: CAP_SYS_ADMIN, as in an unprivileged container) or has none to give (EINVAL/EOPNOTSUPP)
_REFUSED = ("Operation not permitted", "Permission denied")
_UNSUPPORTED = ("Invalid argument", "Operation not supported", "not supported")


@functools.cache
def why_unavailable() -> str | None:
    """Why this machine cannot make a network namespace, or ``None`` when it can: probed once a process.

    The probe adds a namespace of its own and deletes it. Any other failure of that ``ip netns
    add`` is not a machine that cannot but something to look at.

    :raises NetworkError: ``ip netns add`` failed for a reason that is none of the above.
    """
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    if not os.path.exists("/proc/self/ns/net"):
        return "this kernel has no network namespaces (no /proc/self/ns/net)"
    probe = f"kvp-probe-{secrets.token_hex(3)}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if added.returncode == 0:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True, check=False)
        return None
    said = added.stderr.strip() or f"exit status {added.returncode}"
    if any(mark in said for mark in _REFUSED):
        return f"the kernel refuses this process a network namespace (ip netns add: {said})"
    if any(mark in said for mark in _UNSUPPORTED):
        return f"this kernel does not support network namespaces (ip netns add: {said})"
    raise NetworkError(f"ip netns add {probe}: {said}")


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its address, and its link's end on the bridge."""

    namespace: str
    address: str
    link: str

    @property
    def launcher(self) -> list[str]:
        """What a command runs under to run in this namespace."""
        return ["ip", "netns", "exec", self.namespace]


class Network:
    """A bridge on ``{TEST_RANGE}.N.1`` and the hosts added to it. Use as a context manager."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        self.subnet = f"{TEST_RANGE}.{secrets.randbelow(254) + 1}"
        self.gateway = f"{self.subnet}.1"
        self.bridge = f"kvb{self.tag}"
        self.hosts: list[Host] = []
        self._made_bridge = False

    def __enter__(self) -> Self:
        """:raises NetworkUnavailable: this machine cannot make namespaces.

        :raises NetworkError: an ``ip`` command failed.
        """
        if (reason := why_unavailable()) is not None:
            raise NetworkUnavailable(reason)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made_bridge = True
            _ip("addr", "add", f"{self.gateway}/{PREFIX_LEN}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts:
            subprocess.run(["ip", "netns", "delete", host.namespace], capture_output=True, check=False)
            subprocess.run(["ip", "link", "delete", host.link], capture_output=True, check=False)
        self.hosts.clear()
        if self._made_bridge:
            subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, check=False)
            self._made_bridge = False

    def add_host(self) -> Host:
        """A new namespace with its own address, its loopback up, linked to the bridge.

        :raises NetworkError: an ``ip`` command failed (the message quotes it).
        """
        n = len(self.hosts) + 2
        host = Host(f"kvp-{self.tag}-{n}", f"{self.subnet}.{n}", f"kvv{self.tag}{n}")
        self.hosts.append(host)  # from here on __exit__ deletes it, made whole or not
        _ip("netns", "add", host.namespace)
        _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        _ip("link", "set", host.link, "master", self.bridge, "up")
        inside = ["ip", "netns", "exec", host.namespace, "ip"]
        _run([*inside, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", "eth0"])
        _run([*inside, "link", "set", "eth0", "up"])
        _run([*inside, "link", "set", "lo", "up"])
        return host

    def cut(self, host: Host) -> None:
        """Partition ``host``: its link on the bridge goes down (nothing reaches it, it reaches nothing)."""
        _ip("link", "set", host.link, "down")

    def restore(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(command: list[str]) -> None:
    argv = [*command]  # an argument list, never a shell line
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetworkError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
