"""The real store: Mooncake's client behind kvpipe's Store, and the processes around it.

- :mod:`.settings`: :class:`MooncakeSettings` (where the store is, how to join it),
  sizes read as vLLM reads them, and vLLM's Mooncake JSON file.
- :mod:`.client`: :class:`MooncakeStore`, the native client's wrapper: a closed state,
  fast one-line connection errors, RPC deadlines and no 4.5 s calls while the master
  is gone.
- :mod:`.master_resolution`: the master a client talks to, named or spawned.
- :mod:`.reachability`: whether a master serves, checked before ``setup()``.
- :mod:`.segment_liveness`: which store nodes are alive between the master's heartbeats,
  and so which objects are readable (replica checks).
- :mod:`.replica_places`: where each object's replicas lie, remembered between lookups so
  that a check asks the master only about keys it has not placed lately.
- :mod:`.registry`: the process-wide state (shared clients, the etcd joined, the
  environment the user set), in one object.
- :mod:`.environment`: the settings the native client reads from the environment only.
- :mod:`.master`: a local ``mooncake_master`` on free loopback ports, and the
  process helpers (free ports, listening checks, SIGTERM as an unwinding exit).
- :mod:`.master_address`: ``host:port``, ``etcd://...``, ``redis://...``: where the
  master is and whether one leads.
- :mod:`.listening`: whether a port accepts connections (the probe both of the above use).
- :mod:`.cluster`: a local HA cluster (etcd, masters, store nodes).
- :mod:`.store_node`: ``kvpipe store``, a client that only lends memory.
- :mod:`.harness`: faults and looks inside for tests and benches (pausing a master, an
  HA cluster's durable puts); no runtime module imports it.

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
