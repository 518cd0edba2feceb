"""Side-by-side timing: contenders run alternately, each figure is a median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def alternate(contenders: Mapping[str, Callable[[], float | None]], repeats: int) -> dict[str, float]:
    """Median seconds per contender over ``repeats`` rounds, the contenders taking turns.

    Taking turns spreads the machine's slow and fast moments over all of them, which
    is what makes their ratios hold when absolute times do not. One untimed round
    of each comes first, so first-use costs (page faults, registrations, a pool's
    allocation) are paid by no timed round. A contender may return its own
    measured seconds (to leave its set-up out); ``None`` means "time the whole call".
    """
    for contender in contenders.values():
        contender()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, contender in contenders.items():
            started = time.perf_counter()
            own = contender()
            samples[name].append(own if own is not None else time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


def seconds(work: Callable[[], object]) -> float:
    """How long ``work()`` took."""
    started = time.perf_counter()
    work()
    return time.perf_counter() - started
