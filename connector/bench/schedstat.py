"""How long a thread was scheduled: on a CPU or runnable in the run queue (Linux schedstat).

A span's wall time minus that is the time the thread slept in it: waiting for a
lock, the interpreter lock or I/O, which is what "blocked" means. The rest is the
OS sharing the cores among threads: no code waits. The fault tests bound a
submit's blocked time with it, the vLLM bench the connector's hooks'.
"""

from __future__ import annotations

from kvpipe.pipeline.priority import ThreadSchedstat


class ScheduledTime(ThreadSchedstat):
    """Seconds the thread that made this was on a CPU or waiting in the run queue for one.

    Read around every hook of every step, hence :class:`ThreadSchedstat`'s one open.

    :raises OSError: (when made) no ``/proc/thread-self/schedstat`` (not Linux, or a kernel without schedstats).
    """

    def seconds(self) -> float:
        return sum(self.times())
