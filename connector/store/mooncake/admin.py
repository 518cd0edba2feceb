"""The Mooncake master's admin HTTP server (``--metrics_port``): the store's keys, replicas and segments.

Why: a Mooncake client can say whether a key exists, but not which keys exist nor
where their replicas live; the master's admin HTTP can, and reading it touches no
lease. On the master this was written against (mooncake-transfer-engine-non-cuda
0.3.13.post1) it serves, among others, ``/get_all_keys`` (every key, one a line),
``/batch_query_keys?keys=a,b`` (per key its replicas: ``size_``, ``transport_endpoint_``),
``/get_segments_detail`` (per mounted segment: name, ``te_endpoint``, capacity, used
bytes) and ``/role``. Unlike a client's ``batch_get_replica_desc``, ``get_size`` or
``batch_is_exist`` (and the admin ``/query_key``), ``/batch_query_keys`` grants no read
lease (measured: a ``remove`` right after it succeeds, after the others it is -706), so
listing a store does not change what it evicts next. Keys are asked for in batches of
:data:`QUERY_BATCH`, so thousands of keys cost a few requests.

Every call is one HTTP request bounded by the client's timeout, and fails as
:class:`AdminError` with a one-line message: never the Mooncake client's ~90 s retry.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "ADMIN_DEFAULT_PORT",
    "QUERY_BATCH",
    "AdminClient",
    "AdminError",
    "Replica",
    "Segment",
    "find_admin",
]

#: the master's ``--metrics_port`` when it is started without one
ADMIN_DEFAULT_PORT = 9003
#: keys per ``/batch_query_keys`` request (~130 bytes a key: URLs of ~64 KiB; 3000 keys measured fine)
QUERY_BATCH = 512


class AdminError(RuntimeError):
    """The admin HTTP did not answer, or answered what cannot be read; the message says which, in one line."""


class Replica(NamedTuple):
    """One copy of an object, as ``/batch_query_keys`` lists it."""

    size: int
    endpoint: str  # the transfer endpoint of the segment holding it; "" when not in memory


@dataclass(frozen=True)
class Segment:
    """A mounted segment, as ``/get_segments_detail`` lists it."""

    name: str
    endpoint: str
    capacity_bytes: int
    used_bytes: int


class AdminClient:
    """The admin HTTP server of one master at ``host:port``; every call raises :class:`AdminError`."""

    def __init__(self, host: str, port: int, timeout_s: float = 5.0) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def role(self) -> str | None:
        """``leader`` or ``standby`` (HA), as ``/role`` says; None if this master has no such page."""
        text = self._get("/role", missing_ok=True)
        return None if text is None else text.strip()

    def keys(self) -> list[str]:
        """Every key the master holds (``/get_all_keys``)."""
        return [line for line in (self._get("/get_all_keys") or "").splitlines() if line.strip()]

    def replicas(self, keys: Sequence[str]) -> dict[str, list[Replica]]:
        """The replicas of each of ``keys`` that is still stored (``/batch_query_keys``, batched).

        A key gone since it was listed (evicted, removed) is left out. Keys must
        hold no comma (the endpoint's separator); keys in kvpipe's format hold none.
        """
        found: dict[str, list[Replica]] = {}
        for start in range(0, len(keys), QUERY_BATCH):
            batch = keys[start : start + QUERY_BATCH]
            query = urllib.parse.quote(",".join(batch), safe="@:,")
            path = "/batch_query_keys"
            document = self._parse(self._get(f"{path}?keys={query}") or "", path)
            data = document.get("data") if isinstance(document, dict) else None
            if not isinstance(data, dict):
                raise AdminError(f"the master at {self.address} answered {path} without data")
            for key in batch:
                entry = data.get(key)
                if isinstance(entry, dict) and entry.get("ok") and (copies := _replicas(entry)):
                    found[key] = copies
        return found

    def segments(self) -> list[Segment] | None:
        """The mounted segments (``/get_segments_detail``); None if this master has no such page."""
        text = self._get("/get_segments_detail", missing_ok=True)
        if text is None:
            return None
        document = self._parse(text, "/get_segments_detail")
        return [
            Segment(
                str(entry.get("segment_name", "")),
                str(entry.get("te_endpoint", "")),
                int(entry.get("allocator_capacity_bytes", entry.get("size_bytes", 0))),
                int(entry.get("allocator_used_bytes", 0)),
            )
            for entry in (document.get("segments") or [] if isinstance(document, dict) else [])
        ]

    def _get(self, path: str, *, missing_ok: bool = False) -> str | None:
        """The body ``path`` answers; None for a 404 when ``missing_ok`` (a page this master lacks)."""
        url = f"http://{self.host}:{self.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as answer:  # noqa: S310 - the operator's master
                body: bytes = answer.read()
                return body.decode(errors="replace")
        except urllib.error.HTTPError as error:
            if missing_ok and error.code == 404:
                return None
            raise AdminError(
                f"the master's admin HTTP at {self.address} answered {error.code} to {path.split('?')[0]}"
            ) from None
        except (OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise AdminError(
                f"no master admin HTTP answers at {self.address} ({reason}; waited at most {self.timeout_s:g} s)"
            ) from None

    def _parse(self, text: str, path: str) -> object:
        """``text`` as JSON; :class:`AdminError` naming ``path`` when it is none."""
        try:
            document: object = json.loads(text)
        except json.JSONDecodeError:
            raise AdminError(f"the master at {self.address} answered {path} with no JSON") from None
        return document


def _replicas(entry: Mapping[str, Any]) -> list[Replica]:
    """The replicas one ``/batch_query_keys`` entry lists: in memory (with their endpoint), then on disk."""
    in_memory = [
        Replica(int(value.get("size_", 0)), str(value.get("transport_endpoint_", "")))
        for value in entry.get("values") or []
    ]
    return in_memory + [Replica(int(value.get("size_", 0)), "") for value in entry.get("disk_values") or []]


def find_admin(candidates: Sequence[tuple[str, int]], timeout_s: float = 5.0) -> AdminClient:
    """The first of ``candidates`` (``(host, port)``) that answers and does not stand by (HA).

    :raises AdminError: none is given, none answers, or every one that answers is a
        standby (a standby's admin HTTP lists nothing of the store); the message
        names each candidate's problem.
    """
    if not candidates:
        raise AdminError("no admin endpoint given")
    problems: list[str] = []
    for host, port in candidates:
        admin = AdminClient(host, port, timeout_s)
        try:
            role = admin.role()
        except AdminError as error:
            problems.append(str(error))
            continue
        if role == "standby":
            problems.append(f"the master at {admin.address} stands by (its /role); give the leader's")
            continue
        return admin
    raise AdminError("; ".join(problems))
