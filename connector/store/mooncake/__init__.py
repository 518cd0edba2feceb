"""The real store: Mooncake's client behind kvpipe's Store, and the processes around it.

- :mod:`.settings`: :class:`MooncakeSettings` (where the store is, how to join it),
  sizes read as vLLM reads them, and vLLM's Mooncake JSON file.
- :mod:`.client`: :class:`MooncakeStore`, a set-up client with a closed state,
  fast one-line connection errors, RPC deadlines and no 4.5 s calls while the
  master is gone.
- :mod:`.master`: a local ``mooncake_master`` on free loopback ports, and the
  process helpers (free ports, listening checks, SIGTERM as an unwinding exit).
- :mod:`.master_address`: ``host:port``, ``etcd://...``, ``redis://...``: where the
  master is and whether one leads.
- :mod:`.cluster`: a local HA cluster (etcd, masters, store nodes).
- :mod:`.store_node`: ``kvpipe store``, a client that only lends memory.
- :mod:`.segment_liveness`: which store nodes are alive between the master's heartbeats.

``mooncake`` itself is imported only when a client opens, so all of this imports
without the ``mooncake`` extra.
"""

from .client import MooncakeError, MooncakeStore
from .master import MasterError
from .settings import MIN_SEGMENT_BYTES, ClusterSpawn, MooncakeConfigError, MooncakeSettings, parse_size

__all__ = [
    "MIN_SEGMENT_BYTES",
    "ClusterSpawn",
    "MasterError",
    "MooncakeConfigError",
    "MooncakeError",
    "MooncakeSettings",
    "MooncakeStore",
    "parse_size",
]
