"""Drive one stage alone, without a runtime: a recording :class:`Emit`.

``await stage.process(item, emit := RecordingEmit())`` then assert on
``emit.emitted["out"]``, ``emit.dropped``, ``emit.failures``, ``emit.counts``.
For a batch stage, :func:`batch_of` builds entries each with its own recorder, as
the runtime gives each job its own handle.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .stage import DEFAULT_PORT, BatchEntry


@dataclass
class RecordingEmit:
    emitted: defaultdict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    released: list[Any] = field(default_factory=list)  # items emitted with released=True
    dropped: list[str] = field(default_factory=list)
    failures: list[str | BaseException] = field(default_factory=list)
    failed_units: int = 0
    succeeded_units: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    expired: bool = False

    async def __call__(self, item: Any, port: str = DEFAULT_PORT, *, released: bool = False) -> None:
        self.emitted[port].append(item)
        if released:
            self.released.append(item)

    def drop(self, reason: str) -> None:
        self.dropped.append(reason)

    def fail(self, error: str | BaseException, units: int = 1) -> None:
        self.failures.append(error)
        self.failed_units += units

    def succeed(self, units: int = 1) -> None:
        self.succeeded_units += units

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n


def batch_of(items: Iterable[Any]) -> list[BatchEntry[Any]]:
    """One batch entry per item, each with its own :class:`RecordingEmit`."""
    return [BatchEntry(item, RecordingEmit()) for item in items]
