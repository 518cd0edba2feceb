"""The ``kvpipe`` commands, one module each: ``add_parser(commands)`` declares its arguments
and binds ``args.command``, the function that runs it and returns the exit code.

- :mod:`.run`: the main job (``kvpipe run``, ``make run``);
- :mod:`.bench`: the performance suite;
- :mod:`.store`: a store node lending its memory (and a disk tier) to the store;
- :mod:`.inspect`: what a live store holds of one model;
- :mod:`.fleet`: ``vllm serve`` replicas behind vLLM's router over one store.

Each raises :class:`~kvpipe.connector.cli.usage.UsageError` for input the user can fix.
"""

from types import ModuleType

from . import bench, fleet, inspect, run, store

#: in the order ``kvpipe --help`` lists them
COMMANDS: tuple[ModuleType, ...] = (run, bench, store, inspect, fleet)
