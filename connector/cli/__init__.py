"""The ``kvpipe`` command line (:mod:`.main`) and the jobs only it runs.

- :mod:`.main`: the parser and the dispatch, one-line errors with exit 2, SIGTERM
  handling; :mod:`.commands`: each command (``run | bench | store | inspect | fleet``)
  in a module of its own; :mod:`.usage`: the user's error and the checks every
  command shares.
- :mod:`.run`: the main job: a synthetic workload saved through the pipeline,
  read back, checked and reported (``kvpipe run``, ``make run``).
- :mod:`.inspect`: what a live Mooncake store holds of one model's KV cache,
  read from the master's admin HTTP only (``kvpipe inspect``).

``kvpipe store`` is :mod:`kvpipe.connector.store.mooncake.store_node`, and
``kvpipe bench`` is :mod:`kvpipe.connector.bench`: they live with what they run.
"""
