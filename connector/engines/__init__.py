"""Starting vLLM engines with a connector on a local master: below the fleet and the bench.

- :mod:`.launch`: dummy model folders, the ``kv_transfer_config`` of kvpipe's
  connector and of vLLM's own, the store settings and Mooncake JSON of one master,
  an in-process engine and one timed pass of greedy generation over it. The demo,
  the tests, the bench and the fleet (its ``vllm serve`` replicas' configs) share it.

Importing it does not import vLLM: the functions that run an engine do.
"""
