"""How many OpenMP worker threads this process holds, seen from /proc.

torch's CPU build runs its parallel regions on libgomp. Each thread that starts a
parallel region gets a pool of workers of its own; once the workers outnumber the
cores, libgomp stops spinning at its barriers and every region of every pool pays
futex sleeps and wakes. So a connector thread that runs one parallel torch op
slows the engine's own steps from then on. A worker is idle at a futex call made
from inside libgomp, which is how it is told apart from every other thread. One
still spinning (the first milliseconds after its region) is not seen:
:func:`openmp_workers` waits that out.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: longer than libgomp spins at a barrier before it sleeps (a few milliseconds)
SETTLE_S = 0.1


def _libgomp_code() -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and "libgomp" in fields[5] and "x" in fields[1]:
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


def openmp_workers() -> int:
    """The threads now asleep inside libgomp (its idle workers), after :data:`SETTLE_S`."""
    time.sleep(SETTLE_S)
    code = _libgomp_code()
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/syscall").read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        if len(fields) > 2 and any(low <= int(fields[-1], 16) < high for low, high in code):
            count += 1
    return count
