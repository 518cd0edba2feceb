"""Where the Mooncake master is: one ``host:port``, or an HA cluster behind etcd or redis.

Mooncake's client takes three forms of ``master_server_address``:

- ``host:port``: one master;
- ``etcd://h1:p1;h2:p2``: HA masters that elect a leader in etcd (``--enable_ha``);
  the client finds the leader there and follows it when it moves;
- ``redis://host:port`` (optionally with ``user:password@``): the same over redis.

kvpipe checks a master before ``setup()`` (which otherwise retries for ~90 s) and,
after a call found it gone, before the next call (the client's own reconnection
costs ~4.5 s a call). For one master that check is its port. In HA the port of a
master says nothing (a standby listens on none until it leads, and the leader
moves), so the check asks what tells the truth: the leader etcd records
(``mooncake-store/<cluster>/master_view``, its ``host:port``) and whether it
listens. Behind redis the client's own calls decide (the breaker bounds their cost).

``<cluster>`` is the one the client joins: ``MC_STORE_CLUSTER_ID``, else
``mooncake_cluster`` (:func:`cluster_id`). One etcd may serve several clusters,
each its own masters under its own id; the leader of another cluster says nothing
of ours (it may lead while ours is gone, or be gone while ours leads).
"""

from __future__ import annotations

import base64
import json
import os
import urllib.request
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from .listening import is_listening

#: the variable that names the cluster a client joins (its masters' ``--cluster_id``)
CLUSTER_ID_ENV = "MC_STORE_CLUSTER_ID"
#: the cluster a client joins and a master leads when none is named
DEFAULT_CLUSTER_ID = "mooncake_cluster"
ADDRESS_FORMS = "'host:port', 'etcd://host:port[;host:port...]' or 'redis://[user:password@]host:port'"


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)``; ValueError naming the problem otherwise."""
    host, sep, port_text = address.strip().rpartition(":")
    if not sep or not host or any(c.isspace() for c in host) or "/" in host:
        raise ValueError(f"must be {ADDRESS_FORMS} (e.g. '127.0.0.1:50051') or 'spawn'")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError("must be 'host:port' with a port in 1..65535")
    return host.strip("[]"), int(port_text)


@dataclass(frozen=True)
class MasterAddress:
    """A parsed ``master_server_address``: its kind and the endpoints it names.

    ``endpoints`` are the master itself (``direct``) or the coordinators that know
    the leader (``etcd``, ``redis``).
    """

    text: str
    kind: Literal["direct", "etcd", "redis"]
    endpoints: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, text: str) -> MasterAddress:
        """Raises ValueError naming what is wrong (the forms are listed in :data:`ADDRESS_FORMS`)."""
        text = text.strip()
        scheme, sep, rest = text.partition("://")
        if not sep:
            return cls(text, "direct", (split_host_port(text),))
        if scheme == "etcd":
            parts = [part for part in rest.split(";") if part.strip()]
            if not parts:
                raise ValueError(f"names no etcd endpoint: must be {ADDRESS_FORMS}")
            return cls(text, "etcd", tuple(split_host_port(part) for part in parts))
        if scheme == "redis":
            url = urlsplit(text)
            if not url.hostname or not url.port:
                raise ValueError(f"must be {ADDRESS_FORMS} with a host and a port")
            return cls(text, "redis", ((url.hostname, url.port),))
        raise ValueError(f"has scheme {scheme!r}: must be {ADDRESS_FORMS}")

    @property
    def is_ha(self) -> bool:
        return self.kind != "direct"

    def coordinators_listening(self, timeout_s: float) -> bool:
        return any(is_listening(host, port, timeout_s=timeout_s) for host, port in self.endpoints)

    def leader(self, timeout_s: float) -> tuple[str, int] | None:
        """The master that serves now, where that can be known: the address, or etcd's record."""
        if self.kind == "direct":
            return self.endpoints[0]
        if self.kind == "etcd":
            for host, port in self.endpoints:
                leader = etcd_leader(host, port, timeout_s)
                if leader is not None:
                    return leader
        return None

    def serving(self, timeout_s: float) -> bool:
        """Whether a master would answer now: the master's port, or the recorded leader's.

        Behind redis the leader is not looked up: the coordinator listening is
        all this says, and the client's own call tells the rest.
        """
        if self.kind == "redis":
            return self.coordinators_listening(timeout_s)
        leader = self.leader(timeout_s)
        return leader is not None and is_listening(*leader, timeout_s=timeout_s)


def etcd_range(host: str, port: int, prefix: bytes, timeout_s: float) -> list[tuple[bytes, bytes]] | None:
    """Every ``(key, value)`` under ``prefix`` in the etcd at ``host:port`` (its v3 JSON gateway); None if it does not answer."""
    body = {
        "key": base64.b64encode(prefix).decode(),
        "range_end": base64.b64encode(prefix[:-1] + bytes([prefix[-1] + 1])).decode(),
    }
    request = urllib.request.Request(f"http://{host}:{port}/v3/kv/range", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - an etcd of the deployment
            found = json.loads(response.read())
    except (OSError, ValueError):
        return None
    return [
        (base64.b64decode(entry.get("key", "")), base64.b64decode(entry.get("value", "")))
        for entry in found.get("kvs", [])
    ]


def cluster_id() -> str:
    """The cluster this process's Mooncake client joins: ``MC_STORE_CLUSTER_ID``, else the default."""
    return os.environ.get(CLUSTER_ID_ENV) or DEFAULT_CLUSTER_ID


def leader_key(cluster: str) -> bytes:
    """Where ``cluster``'s HA masters record their leader in etcd."""
    return f"mooncake-store/{cluster}/master_view".encode()


def etcd_leader(host: str, port: int, timeout_s: float) -> tuple[str, int] | None:
    """The leading master of this process's cluster (:func:`cluster_id`) that etcd at ``host:port`` records, or None."""
    key = leader_key(cluster_id())
    for found, value in etcd_range(host, port, key, timeout_s) or []:
        if found == key:
            try:
                return split_host_port(value.decode())
            except ValueError:
                return None
    return None
