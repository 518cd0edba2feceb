"""How long a thread was scheduled: on a CPU or runnable in the run queue (Linux schedstat).

A span's wall time minus that is the time the thread slept in it: waiting for a
lock, the interpreter lock or I/O, which is what "blocked" means. The rest is the
OS sharing the cores among threads: no code waits. The fault tests bound a
submit's blocked time with it, the vLLM bench the connector's hooks'.
"""

from __future__ import annotations

import os


class ScheduledTime:
    """Seconds the thread that made this was on a CPU or waiting in the run queue for one.

    The file is opened once and read with ``pread``: a reading costs ~3 us, a tenth
    of opening ``/proc`` afresh, which matters read around every hook of every step.
    """

    def __init__(self) -> None:
        """Open the calling thread's schedstat (``/proc/thread-self`` resolves to it now, for good).

        :raises OSError: no ``/proc/thread-self/schedstat`` (not Linux, or a kernel without schedstats).
        """
        self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def seconds(self) -> float:
        on_cpu, in_run_queue, _ = os.pread(self._fd, 128, 0).split()
        return (int(on_cpu) + int(in_run_queue)) / 1e9
