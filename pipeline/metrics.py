"""Per-stage counters and processing-time percentiles.

Updated on the loop thread on every item, so they are plain attributes: no locks,
no allocation per item beyond one float in a bounded window. Other threads read a
:meth:`StageMetrics.snapshot`, which is consistent enough for reporting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: How many recent processing times the percentiles are computed over.
WINDOW = 4096


@dataclass(frozen=True)
class StageSnapshot:
    stage: str
    items_in: int
    items_out: int
    dropped: int
    errors: int
    queue_depth: int
    p50_ms: float
    p99_ms: float
    passes_through: bool = False  # it would pass every item through unchanged: the runtime never ran it
    fused: bool = False  # run inline by its producer's task (no inbox: its queue depth is always 0)

    def as_dict(self) -> dict[str, float | int | bool]:
        return {
            "in": self.items_in,
            "out": self.items_out,
            "dropped": self.dropped,
            "errors": self.errors,
            "queue_depth": self.queue_depth,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "passes_through": self.passes_through,
            "fused": self.fused,
            # its name before 2026-12: the run report's field names are a contract
            "wired_around": self.passes_through,
        }


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an already sorted list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, round(fraction * len(sorted_values)) - 1))
    return sorted_values[index]


class StageMetrics:
    __slots__ = ("stage", "items_in", "items_out", "dropped", "errors", "durations", "queue_depth")

    def __init__(self, stage: str, queue_depth: Callable[[], int] = lambda: 0) -> None:
        self.stage = stage
        self.items_in = 0
        self.items_out = 0
        self.dropped = 0
        self.errors = 0
        self.durations: deque[float] = deque(maxlen=WINDOW)
        self.queue_depth = queue_depth

    def snapshot(self, *, passes_through: bool = False, fused: bool = False) -> StageSnapshot:
        durations = sorted(self.durations)
        return StageSnapshot(
            stage=self.stage,
            items_in=self.items_in,
            items_out=self.items_out,
            dropped=self.dropped,
            errors=self.errors,
            queue_depth=self.queue_depth(),
            p50_ms=percentile(durations, 0.50) * 1e3,
            p99_ms=percentile(durations, 0.99) * 1e3,
            passes_through=passes_through,
            fused=fused,
        )
