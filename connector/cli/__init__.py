"""The ``kvpipe`` command line (:mod:`.main`): parsing, the commands, and what only ``inspect`` runs.

- :mod:`.main`: the parser and the dispatch, one-line errors with exit 2, SIGTERM
  handling; :mod:`.commands`: each command (``run | bench | store | inspect | fleet``)
  in a module of its own; :mod:`.usage`: the user's error and the checks every
  command shares.
- :mod:`.inspect`: what a live Mooncake store holds of one model's KV cache,
  read from the master's admin HTTP only (``kvpipe inspect``).

``kvpipe run``'s job is :mod:`kvpipe.connector.run` (the bench runs it too), ``kvpipe
store`` is :mod:`kvpipe.connector.store.mooncake.store_node`, ``kvpipe bench`` is
:mod:`kvpipe.connector.bench` and ``kvpipe fleet`` is :mod:`kvpipe.connector.fleet`:
they live with what they run, below the command line.
"""
