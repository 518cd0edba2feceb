"""Where the outside world plugs into kvpipe's pipeline and stages: five rooms.

- :mod:`.store`: the store every stage talks to. Its protocol (Mooncake's batch
  API), the configs that choose and open one, the breaker and the meter that wrap
  any store, the in-process model (:mod:`.store.memory`) and the real Mooncake
  client with the processes around it (:mod:`.store.mooncake`: settings, client,
  masters, HA clusters, store nodes).
- :mod:`.vllm`: kvpipe as a vLLM KV connector (``kv_connector_module_path``
  ``kvpipe.connector.vllm``): the scheduler side, the worker side, the KV layouts,
  staging, stats, Prometheus series and KV events.
- :mod:`.cli`: the ``kvpipe`` command line and its jobs: ``run`` (the main job,
  :mod:`.cli.run`), ``inspect`` (what a live store holds), ``store`` (a store node)
  and ``bench``.
- :mod:`.bench`: the performance suite, and the helpers that start vLLM engines on
  a local master for it, the demo and the tests (:mod:`.bench.launch`).
- :mod:`.fleet`: a local fleet (``kvpipe fleet``): ``vllm serve`` replicas behind
  vLLM's router over one Mooncake store, every process in a group stopped whole.

Beside the rooms, :mod:`.exit_guard`: every child process a room starts (masters,
etcd, store nodes, a fleet's replicas and router) is stopped when its owner exits,
unless the owner stopped it first.

Rooms import downwards only: ``store`` imports neither ``vllm``, ``cli`` nor
``bench``; ``vllm`` imports ``store``; ``cli`` and ``bench`` may import all;
``fleet`` imports ``store`` and ``bench.launch`` (it runs the connector in processes
of its own, and reads vLLM's KV events).
"""
