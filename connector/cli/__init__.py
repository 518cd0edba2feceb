"""The ``kvpipe`` command line (:mod:`.main`) and the jobs only it runs.

- :mod:`.main`: argument parsing, one-line errors with exit 2, SIGTERM handling;
  ``kvpipe run | bench | store | inspect``.
- :mod:`.run`: the main job: a synthetic workload saved through the pipeline,
  read back, checked and reported (``kvpipe run``, ``make run``).
- :mod:`.inspect`: what a live Mooncake store holds of one model's KV cache,
  read from the master's admin HTTP only (``kvpipe inspect``).

``kvpipe store`` is :mod:`kvpipe.connector.store.mooncake.store_node`, and
``kvpipe bench`` is :mod:`kvpipe.connector.bench`: they live with what they run.
"""
