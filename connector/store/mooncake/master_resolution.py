"""Which master a client talks to: the one its settings name, or one spawned for it.

``master: spawn`` starts a ``mooncake_master`` on free loopback ports
(:class:`~.master.LocalMaster`) or, with ``cluster:`` beside it, a whole local
cluster (:class:`~.cluster.LocalCluster`: etcd, HA masters, store nodes); any other
``master`` is someone else's, joined with the ``metadata_server`` the settings give.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import LocalCluster
from .master import P2P_HANDSHAKE, LocalMaster
from .settings import MooncakeSettings


@dataclass(frozen=True)
class ResolvedMaster:
    """Where a client's master is, and what was spawned to be it (None: someone else's)."""

    master_address: str
    metadata_server: str
    spawned: LocalMaster | LocalCluster | None = None

    def stop(self) -> None:
        """Stop what was spawned (every process of a cluster); nothing for someone else's master."""
        if self.spawned is not None:
            self.spawned.stop()


def resolve_master(settings: MooncakeSettings) -> ResolvedMaster:
    """The master of ``settings``, spawned (and running) if they say ``spawn``.

    :raises MasterError: a spawned master or cluster cannot start (what started is stopped).
    """
    if settings.master != "spawn":
        assert settings.metadata_server is not None  # validated: an existing master needs one
        return ResolvedMaster(settings.master, settings.metadata_server)
    offload = settings.disk is not None  # a client with a disk tier needs a master that offloads
    if settings.cluster is not None:
        spec = settings.cluster
        cluster = LocalCluster(
            spec.masters,
            store_nodes=spec.store_nodes,
            node_segment=str(spec.node_segment),
            node_disk=None if spec.node_disk is None else str(spec.node_disk),
            enable_offload=offload,
        ).start()
        return ResolvedMaster(cluster.master_address, settings.metadata_server or P2P_HANDSHAKE, cluster)
    master = LocalMaster(
        lease_ttl_ms=settings.lease_ttl_ms,
        eviction_high_watermark=settings.eviction_high_watermark,
        eviction_ratio=settings.eviction_ratio,
        client_ttl_s=settings.client_ttl_s,
        enable_offload=offload,
    ).start()
    assert master.endpoints is not None  # set by start()
    return ResolvedMaster(
        master.endpoints.master_address, settings.metadata_server or master.endpoints.metadata_server, master
    )
