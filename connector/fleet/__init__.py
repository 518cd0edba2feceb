"""A local fleet: ``vllm serve`` replicas behind vLLM's router, sharing one Mooncake store.

- :mod:`.fleet`: :class:`~.fleet.Fleet` and its :class:`~.fleet.FleetSpec`: the store
  (a master or an HA cluster, and store nodes), the replicas, the router; ``kvpipe fleet``.
- :mod:`.replica`: one ``vllm serve`` replica, and the router, as HTTP server processes.
- :mod:`.pool_relay`: the shared pool's KV events, relayed to every worker's router stream.
- :mod:`.processes`: a child process in a process group of its own, stopped whole.
- :mod:`.tokenizer`: a word-level tokenizer for a dummy-weight model folder.
"""
