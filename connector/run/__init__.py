"""``kvpipe run``, the main job: a synthetic workload through the save pipeline, checked.

The job itself, below the command line (:mod:`kvpipe.connector.cli.commands.run` parses
its arguments and prints its report) and the bench (whose ``fragmentation`` workload
runs it on a shrinking store).

- :mod:`.config`: the run's YAML (model, workload, store, save settings), every section defaulted;
  :mod:`.config_doc`: docs/configuration.md's tables of its keys, from the fields' descriptions.
- :mod:`.synthetic`, :mod:`.workload`: the synthetic KV cache and the chat-like requests;
  :mod:`.pattern`: the bytes a synthetic block holds, a pure function of its name.
- :mod:`.engine`: the engine stand-in that runs requests in steps and submits their saves.
- :mod:`.job`: the steps end to end; :mod:`.check`: the store read back after the run.
- :mod:`.baselines`: the pipeline alone and raw puts on the run's own objects (``--baselines``).
- :mod:`.report`: the progress line and the summary table.
"""
