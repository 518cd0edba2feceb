"""A store node: a Mooncake client that lends the store memory and does nothing else.

Objects live in the segments clients mount, and a client that closes takes its
segment's objects with it. An engine that mounts its own segment therefore
takes its share of the cache down with it when it restarts. A store node is the
long-lived holder instead: engines mount no segment (vLLM's ``standalone-store``
mode, kvpipe's ``global_segment_size: 0``) and put into the nodes' segments, so
the cache outlives any engine.

:func:`serve` runs one node (``kvpipe store`` is it on the command line): it
joins a master (``host:port``), an HA cluster (``etcd://...``, ``redis://...``)
or spawns a local master, mounts ``global_segment_size`` bytes (and, with ``disk``,
a disk tier behind them: :class:`~.settings.DiskTier`), reports the
settings engines paste (:class:`NodeReady`: kvpipe's ``store:`` block and vLLM's
Mooncake JSON), reports its segment's use every ``report_every_s`` (read off the
master's Prometheus endpoint, when one is known), and unmounts when ``stop`` is
set (the command sets it on SIGTERM and SIGINT).

Raises what :meth:`~.client.MooncakeStore.open` raises: :class:`~.master.MasterError`
or :class:`~.client.MooncakeError`, one line each.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .client import MooncakeStore
from .master import LOOPBACK
from .master_address import split_host_port
from .settings import DiskTier, MooncakeSettings

#: the smallest buffer the client accepts for a node that never puts (its own transfers only)
NODE_BUFFER_BYTES = 16 << 20


@dataclass(frozen=True)
class NodeReady:
    """A node that serves: where it is, and what an engine needs to use it."""

    segment_name: str
    segment_bytes: int
    master: str
    metadata_server: str
    protocol: str
    disk: DiskTier | None = None
    #: the masters' admin HTTP the node knows (``--master-metrics``, a spawned master's)
    master_metrics: tuple[str, ...] = ()

    def kvpipe_store(self) -> dict[str, Any]:
        """The ``store:`` block of a kvpipe config (or the connector's extra config).

        With the masters' admin HTTP in it where the node knows them, so an engine reads
        the store's capacity (retention's default pin budget, docs/retention.md).
        """
        block: dict[str, Any] = {
            "kind": "mooncake",
            "master": self.master,
            "metadata_server": self.metadata_server,
            "protocol": self.protocol,
            "global_segment_size": 0,
        }
        if self.master_metrics:
            block["master_metrics"] = list(self.master_metrics)
        return block

    def vllm_config(self) -> dict[str, Any]:
        """vLLM's Mooncake JSON (``MOONCAKE_CONFIG_PATH``) for an engine of this store."""
        return {
            "mode": "standalone-store",
            "master_server_address": self.master,
            "metadata_server": self.metadata_server,
            "protocol": self.protocol,
            "global_segment_size": 0,
            "local_buffer_size": 1 << 30,
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "event": "ready",
            "segment": self.segment_name,
            "segment_bytes": self.segment_bytes,
            "disk": None if self.disk is None else {"path": str(self.disk.path), "bytes": self.disk.size},
            "master": self.master,
            "master_metrics": list(self.master_metrics),
            "kvpipe_store": self.kvpipe_store(),
            "vllm_config": self.vllm_config(),
        }


@dataclass(frozen=True)
class SegmentUse:
    """How full a node's segment is, as the master counts it."""

    used_bytes: int
    capacity_bytes: int

    def as_json(self) -> dict[str, Any]:
        return {"event": "segment", "used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes}


def node_settings(settings: MooncakeSettings) -> MooncakeSettings:
    """``settings`` as a node needs them: a segment (required) and a small transfer buffer."""
    if settings.global_segment_size == 0:
        raise ValueError("global_segment_size: a store node lends memory, so it must be >= 16 MiB, got 0")
    return settings.model_copy(
        update={"local_buffer_size": min(settings.local_buffer_size, NODE_BUFFER_BYTES)}
    )


def serve(
    settings: MooncakeSettings,
    *,
    stop: threading.Event,
    on_ready: Callable[[NodeReady], None],
    on_use: Callable[[SegmentUse], None],
    master_metrics: Sequence[str] = (),
    report_every_s: float = 10.0,
    close_timeout_s: float = 5.0,
) -> bool:
    """Mount a segment and hold it until ``stop`` is set; then unmount (the store's objects in it go).

    ``master_metrics`` are ``host:port`` of the masters' metrics endpoints (a spawned
    master's is known); without any, no segment use is reported. Returns whether the
    client closed within ``close_timeout_s``: a client of an HA cluster takes ~30 s
    to close (it waits out its etcd watch), and a node that stopped heartbeating is
    dropped by the master after its client TTL anyway, so the caller may exit
    without waiting (``os._exit``: the native close still runs on its thread).
    """
    store = MooncakeStore.open(node_settings(settings))
    try:
        endpoints = [split_host_port(address) for address in master_metrics]
        if (master := store.spawned_master) is not None and master.endpoints is not None:
            endpoints.append((LOOPBACK, master.endpoints.metrics_port))
        ready = NodeReady(
            segment_name=store.hostname(),
            segment_bytes=store.settings.global_segment_size,
            master=store.master_address,
            metadata_server=store.metadata_server,
            protocol=store.settings.protocol,
            disk=store.settings.disk,
            master_metrics=tuple(f"{host}:{port}" for host, port in endpoints),
        )
        on_ready(ready)
        while not stop.wait(report_every_s):
            use = segment_use(endpoints, ready.segment_name, timeout_s=1.0)
            if use is not None:
                on_use(use)
    finally:
        closer = threading.Thread(target=store.close, name="store-node-close", daemon=True)
        closer.start()
        closer.join(close_timeout_s)
        # Decided at the deadline: stopping the master below can outlast the close itself.
        closed = not closer.is_alive()
        if not closed and (master := store.spawned_master) is not None:
            master.stop()  # the node's own master must not outlive the node
    return closed


def segment_use(endpoints: Sequence[tuple[str, int]], segment: str, timeout_s: float) -> SegmentUse | None:
    """The first master's count of ``segment``'s bytes (a standby counts none); None when no master says."""
    from prometheus_client.parser import text_string_to_metric_families

    for host, port in endpoints:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as response:  # noqa: S310
                text = response.read().decode(errors="replace")
        except OSError:
            continue
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("segment") == segment:
                    found[sample.name] = sample.value
        if "segment_allocated_bytes" in found and "segment_total_capacity_bytes" in found:
            return SegmentUse(
                int(found["segment_allocated_bytes"]), int(found["segment_total_capacity_bytes"])
            )
    return None
