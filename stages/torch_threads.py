"""Run one thread's torch ops without an OpenMP parallel region.

torch's CPU build runs its parallel ops on libgomp, which gives each thread
that starts a parallel region a pool of workers of its own. Once the workers
outnumber the cores, libgomp stops spinning at its barriers, and every region
of every pool (an inference engine's forward included) sleeps and wakes on a
futex instead: one parallel op in a pipeline's thread slowed an engine's plain
decode steps (``kvpipe bench vllm-loads``; docs/bench/log/2026-12-04.md). torch sizes a thread's regions by its OpenMP
team size, which libgomp keeps per thread, so a thread whose team is one runs
every op inline and starts no pool, while the engine's thread keeps its own.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable

with warnings.catch_warnings():  # this CPU torch build warns at import that numpy is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

#: libgomp's setter of the calling thread's team size, where the process has it
_omp_set_num_threads: Callable[[int], None] | None = getattr(ctypes.CDLL(None), "omp_set_num_threads", None)

#: whether this process's OpenMP lets a thread set a team size of its own
PER_THREAD_TEAMS = _omp_set_num_threads is not None


def single_threaded_torch() -> bool:
    """Make torch run the calling thread's ops without a parallel region; False where it cannot.

    Never call it on the engine's thread: its forward would lose its parallelism.
    torch sets a thread's team size on the thread's first parallel question, so
    this asks first and sets the size after.
    """
    if _omp_set_num_threads is None:
        return False
    torch.get_num_threads()
    _omp_set_num_threads(1)
    return torch.get_num_threads() == 1
