"""Where the outside world plugs into kvpipe's pipeline and stages: seven rooms.

- :mod:`.store`: the store every stage talks to. Its protocol (Mooncake's batch
  API), the configs that choose and open one, the breaker and the meter that wrap
  any store, the in-process model (:mod:`.store.memory`) and the real Mooncake
  client with the processes around it (:mod:`.store.mooncake`: settings, client,
  masters, HA clusters, store nodes).
- :mod:`.vllm`: kvpipe as a vLLM KV connector (``kv_connector_module_path``
  ``kvpipe.connector.vllm``): the scheduler side, the worker side, the KV layouts,
  staging, stats, Prometheus series and KV events.
- :mod:`.engines`: starting vLLM engines with a connector on a local master
  (:mod:`.engines.launch`): dummy model folders, both connectors' transfer configs,
  the engine itself; what the demo, the tests, the bench and the fleet share.
- :mod:`.run`: ``kvpipe run``, the main job: a synthetic workload saved through the
  pipeline, read back and checked (the bench's ``fragmentation`` workload runs it too).
- :mod:`.fleet`: a local fleet (``kvpipe fleet``): ``vllm serve`` replicas behind
  vLLM's router over one Mooncake store, every process in a group stopped whole.
- :mod:`.bench`: the performance suite (``kvpipe bench``).
- :mod:`.cli`: the ``kvpipe`` command line: its parser and commands (``run``,
  ``inspect``, ``store``, ``bench``, ``fleet``), and ``inspect``'s reading of a live store.

Beside the rooms, :mod:`.exit_guard`: every child process a room starts (masters,
etcd, store nodes, a fleet's replicas and router) is stopped when its owner exits,
unless the owner stopped it first; and :mod:`.timing`: contenders timed taking
turns, for the bench and ``kvpipe run --baselines``.

Rooms import downwards only, in the order above: ``store`` at the bottom, then
``vllm``, ``engines``, ``run`` and ``fleet`` (neither of these two imports the
other; the fleet runs the connector in processes of its own and imports no
``vllm`` room, only vLLM's KV event types), ``bench``, and ``cli`` at the top.
pyproject's ``[tool.importlinter]`` states the order as contracts; ``lint-imports``
(``make test``) checks them.
"""
