"""One engine step's connector calls on a worker side, in the order vLLM 0.32 makes them; no vLLM import.

vLLM binds the step's metadata (kvpipe submits its loads and layer-wise saves then),
calls ``start_load_kv``, and around each attention layer ``wait_for_layer_load``
before it and ``save_kv_layer`` after it; at the step's end ``wait_for_save``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def run_step(side: Any, meta: Any, layers: Sequence[str]) -> None:
    """Drive ``side`` (a :class:`~kvpipe.connector.vllm.worker.WorkerSide`) through one step over ``layers``."""
    side.submit_loads(meta)
    side.start_layered_saves(meta)
    side.start_load_kv(meta)
    for name in layers:
        side.wait_for_layer_load(name)
        side.save_kv_layer(name)
    side.wait_for_save(meta)
