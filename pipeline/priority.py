"""Lower the CPU priority of one thread, so that work it does yields to the host's own.

A pipeline fed from an inference engine's step thread shares the host's cores
with that engine. Where the cores are all busy (a CPU engine's forward keeps
every core), the pipeline's threads and the engine's take turns at equal
weight, and each step gets longer by what the pipeline's threads took. A thread
``n`` nicer gets less of a contended core (Linux weighs nice 0 against nice 10
as 1024 to 110, against nice 19 as 1024 to 15) and all of an idle one: its work
fills the time the engine leaves.

The other side of yielding: a nicer thread waits longer for a CPU while the engine
computes, so a call it makes looks slower than what it called.
:func:`cpu_wait_seconds` reads how long the calling thread has waited in the run
queue, so a caller can tell the time its callee took from the time it spent
yielding (the put stage's slow-store throttle must not read a busy engine as a
slow store).

On Linux a nice value belongs to one thread (``setpriority`` on a thread id),
and a thread inherits the value of the thread that starts it: a pipeline's
worker threads, started from its loop thread, run as nice as the loop. Other
systems set nice values per process, so there this does nothing: lowering the
whole process would slow the engine too.
"""

from __future__ import annotations

import os
import sys
import threading

#: the nicest a thread can be (Linux)
MAX_NICE = 19


def checked_nice(value: object, field: str = "nice") -> int:
    """``value`` when it is a nice increment (0 to 19).

    :raises ValueError: it is not, naming ``field`` and the value.
    """
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_NICE:
        return value
    raise ValueError(f"{field}: must be an integer from 0 to {MAX_NICE}, got {value!r}")


def lower_this_thread(increment: int) -> bool:
    """Make the calling thread ``increment`` nicer than it is (at most 19); threads it starts inherit it.

    Returns whether the thread's priority was lowered: False for 0, on a system
    other than Linux, or when the call is refused (a sandbox may forbid it; an
    unprivileged thread may lower its priority, never raise it back).
    """
    if increment <= 0 or not sys.platform.startswith("linux"):
        return False
    thread = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(MAX_NICE, now + increment))
    except OSError:
        return False
    return True


#: where Linux (with schedstats) tells a thread its times; ``thread-self`` resolves when opened
SCHEDSTAT_PATH = "/proc/thread-self/schedstat"


class ThreadSchedstat:
    """The schedstat of the thread that made it, opened once and read in place (``pread``).

    ``thread-self`` resolves when the file is opened, so an instance reads that
    thread for good, whichever thread asks. A reading costs ~0.7 us where an open
    and a close cost 5 us. ``pid``: a forked child inherits the file, which still
    names the parent's thread.

    :raises OSError: (when made) no schedstat here (not Linux, or a kernel without schedstats).
    """

    def __init__(self, path: str = SCHEDSTAT_PATH) -> None:
        self.path, self.pid = path, os.getpid()
        self._fd = os.open(path, os.O_RDONLY)

    def __del__(self) -> None:
        if (fd := getattr(self, "_fd", None)) is not None:  # None: the open failed
            os.close(fd)

    def times(self) -> tuple[float, float]:
        """Seconds the thread has spent on a CPU, and runnable waiting for one, since it started."""
        on_cpu, waiting, _ = os.pread(self._fd, 128, 0).split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9


_this_thread = threading.local()  # each thread's own ThreadSchedstat, closed with the thread


def cpu_wait_seconds() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU, since it started.

    From the thread's :class:`ThreadSchedstat`, made at its first reading (the put
    stage reads it twice a call); 0.0 where there is none, so a difference of two
    readings is never negative.
    """
    stats: ThreadSchedstat | None = getattr(_this_thread, "schedstat", None)
    if stats is None or stats.path != SCHEDSTAT_PATH or stats.pid != os.getpid():
        try:
            stats = _this_thread.schedstat = ThreadSchedstat(SCHEDSTAT_PATH)
        except OSError:
            return 0.0
    try:
        return stats.times()[1]
    except (OSError, ValueError):
        return 0.0
