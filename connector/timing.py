"""Side-by-side timing: contenders run alternately, each figure is a median.

Beside each contender's seconds, how many cores' worth of CPU its process (and the
processes that work for it) kept busy meanwhile (:attr:`Timed.cores`): a contender
whose rounds read ~1.0 is bound by one thread's worth of work (its Python runs
under one interpreter lock); one well below 1.0 waits for something (a transfer, a
reply). That is what says whether overlapping work can still pay, and which
contender's limit is the machine's rather than its own.

Beside the rooms, as :mod:`kvpipe.connector.exit_guard` is: the bench's workloads
time their contenders with it, and so do ``kvpipe run --baselines``
(:mod:`kvpipe.connector.run.baselines`), which sits below the bench.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple


class Timed(NamedTuple):
    """A span of work: its wall seconds, and the CPU seconds of the whole process (every thread) over it."""

    seconds: float
    cpu_seconds: float

    @property
    def cores(self) -> float:
        """CPU over wall: how many cores' worth the process kept busy (0.0 for an empty span)."""
        return self.cpu_seconds / self.seconds if self.seconds > 0 else 0.0


class Medians(NamedTuple):
    """Per contender: the median round's seconds, and the median of its rounds' :attr:`Timed.cores`.

    ``cores`` names only the contenders that reported a :class:`Timed` (one that
    times itself and reports bare seconds has no CPU figure).
    """

    seconds: dict[str, float]
    cores: dict[str, float]


def alternate(contenders: Mapping[str, Callable[[], Timed | float]], repeats: int) -> Medians:
    """Medians per contender over ``repeats`` rounds, the contenders taking turns.

    Taking turns spreads the machine's slow and fast moments over all of them, which
    is what makes their ratios hold when absolute times do not. One untimed round
    of each comes first, so first-use costs (page faults, registrations, a pool's
    allocation) are paid by no timed round; the timed rounds run on a frozen heap
    (:func:`frozen_heap`). A contender returns its own measurement, which leaves its
    set-up out: a :class:`Timed` (from :func:`timed`), or bare seconds.
    """
    for contender in contenders.values():
        contender()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    cores: dict[str, list[float]] = {}
    with frozen_heap():
        for _ in range(repeats):
            for name, contender in contenders.items():
                own = contender()
                if isinstance(own, Timed):
                    samples[name].append(own.seconds)
                    cores.setdefault(name, []).append(own.cores)
                else:
                    samples[name].append(own)
    return Medians(
        {name: statistics.median(values) for name, values in samples.items()},
        {name: statistics.median(values) for name, values in cores.items()},
    )


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


def timed(work: Callable[[], object], helpers: Sequence[int] = ()) -> Timed:
    """How long ``work()`` took, and the CPU its process spent meanwhile.

    ``helpers``: the pids of processes that work for it (the store node holding the
    segment it writes to): their CPU counts too.
    """
    wall, cpu = time.perf_counter(), time.process_time() + _cpu_seconds(helpers)
    work()
    return Timed(time.perf_counter() - wall, time.process_time() + _cpu_seconds(helpers) - cpu)


def _cpu_seconds(pids: Sequence[int]) -> float:
    """The CPU time the processes ``pids`` have used so far (user + system, all their threads)."""
    if not pids:
        return 0.0
    import psutil  # the bench's own dependency: ``kvpipe run --baselines`` times without it

    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)
