"""kvpipe's connector telling the bench which keys each step's saves will store: what save-visible's engine loads.

The ``save-visible`` workload names this module and :class:`WatchedKVPipeConnector`
in vLLM's ``kv_transfer_config``, so production's connector pays nothing for it.
It is the timed connector (:mod:`.vllm_timed`) too: on a busy engine, how long its
thread slept inside kvpipe's hooks is what a save's priority can cost a step.
The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the bench's
step loop drains :data:`WATCHED` on the thread that stepped the engine.

A save's moment is when ``wait_for_save`` is called: the forward that computed
its blocks has returned, and the worker is about to stage them. Its keys are the
objects every rank stores for each of its chunks (the keys a lookup asks for), made
by the same rules the save pipeline follows (:func:`~kvpipe.stages.chunks.chunks_to_save`,
:func:`~kvpipe.stages.keys.object_key`), so a chunk the filter skips because
another save stored it is still watched and found at once.

Importing this module imports vLLM: the bench's parent process only names it, by strings.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from kvpipe.stages.chunks import chunks_to_save
from kvpipe.stages.keys import object_key

from .vllm_timed import TimedKVPipeConnector


class WatchedSave(NamedTuple):
    """One request's save of one step: when its blocks were computed, and the keys it stores."""

    computed_at: float  # time.monotonic()
    request_id: str
    keys: list[str]


#: Saves the engine in this process handed to its worker, oldest first; the bench drains it.
WATCHED: deque[WatchedSave] = deque()


class WatchedKVPipeConnector(TimedKVPipeConnector):
    """kvpipe's timed connector, each step's saves put on :data:`WATCHED` before the worker stages them."""

    def wait_for_save(self) -> None:
        computed_at = time.monotonic()
        cache = self._worker().cache
        for save in self._metadata().saves:
            keys = [
                object_key(namespace, chunk.group.store_group, chunk.chunk_hash)
                for chunk in chunks_to_save(save, cache.store_groups, cache.hash_block_size)
                for namespace in cache.chunk_namespaces
            ]
            if keys:
                WATCHED.append(WatchedSave(computed_at, save.request_id, keys))
        super().wait_for_save()
