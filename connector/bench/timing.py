"""Side-by-side timing: contenders run alternately, each figure is a median."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager


def alternate(contenders: Mapping[str, Callable[[], float | None]], repeats: int) -> dict[str, float]:
    """Median seconds per contender over ``repeats`` rounds, the contenders taking turns.

    Taking turns spreads the machine's slow and fast moments over all of them, which
    is what makes their ratios hold when absolute times do not. One untimed round
    of each comes first, so first-use costs (page faults, registrations, a pool's
    allocation) are paid by no timed round; the timed rounds run on a frozen heap
    (:func:`frozen_heap`). A contender may return its own
    measured seconds (to leave its set-up out); ``None`` means "time the whole call".
    """
    for contender in contenders.values():
        contender()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    with frozen_heap():
        for _ in range(repeats):
            for name, contender in contenders.items():
                started = time.perf_counter()
                own = contender()
                samples[name].append(own if own is not None else time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the garbage collector off what exists now, as vLLM's engine does after start-up.

    vLLM freezes its heap once loaded (``freeze_gc_heap`` in ``vllm/v1/engine/core.py``),
    so a connector's garbage is collected without re-scanning the engine's objects. The
    workloads' set-up (tensors, requests, precomputed keys) would otherwise be scanned
    by every full collection, a cost a serving process does not pay.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def seconds(work: Callable[[], object]) -> float:
    """How long ``work()`` took."""
    started = time.perf_counter()
    work()
    return time.perf_counter() - started
