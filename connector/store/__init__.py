"""The store: one protocol, the configs that open a backend, what wraps any backend.

- :mod:`.protocol`: :class:`~.protocol.Store`, the backend contract (Mooncake's
  own batch API, so the real client needs no translation), and
  :class:`~.protocol.ForwardingStore`, the base of every wrapper.
- :mod:`.configs`: ``store: {kind: memory | mooncake, breaker: ...}`` validated,
  and :func:`~.configs.connect` / :func:`~.configs.open_store`, which open one.
- :mod:`.breaker`: fail fast while the master is gone (a circuit breaker).
- :mod:`.metered`: each master call's operation, outcome, time, keys and bytes.
- :mod:`.memory`: the in-process model of Mooncake Store (fast tests, the demo).
- :mod:`.mooncake`: the real store: settings, the client, and the local processes
  (masters, HA clusters with etcd, store nodes) tests and demos spawn.

The store-facing roles the stages need (what saving needs, what loading needs)
are defined in :mod:`kvpipe.stages.store`; :class:`~.protocol.Store` is their union
plus what only a backend offers (single-buffer forms, removal, group-id support).
"""
