"""What a class's hooks cost the thread that calls them: its CPU, and its time blocked.

The vLLM bench's measure of kvpipe's connector on the engine's critical path
(:mod:`.vllm_timed`). Wall-time ratios on a shared 2-core machine measure the
contention as much as the connector; a thread's own CPU clock does not, so each
hook call is timed on the calling thread's clocks:

- CPU: ``time.thread_time()`` (this thread's CPU time, never another's);
- blocked: wall time minus the time the thread was on a CPU or in the run queue
  (:class:`.ScheduledTime`): the time it slept in the hook, waiting for the
  interpreter lock while other threads (kvpipe's pipelines) run Python, for a lock,
  or for I/O. Waiting in the run queue is the OS sharing the cores, not the hook's.

:meth:`HookClock.take` also reports the calling thread's CPU over the same span:
the denominator of the hooks' share. Production connectors carry none of this:
:func:`timed_hooks` makes the timing a property of a subclass the bench loads.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from .schedstat import ScheduledTime

T = TypeVar("T", bound=type)


@dataclass
class HookTime:
    """One hook's calls: their count, and their totals of thread CPU, wall and blocked seconds."""

    calls: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    blocked_s: float = 0.0
    max_blocked_s: float = 0.0  # the longest one call slept


@dataclass(frozen=True)
class HookReport:
    """The hooks' times over a span, beside the CPU the calling thread used in all of it."""

    thread_cpu_s: float  # hooks included
    hooks: Mapping[str, HookTime] = field(default_factory=dict)

    @property
    def calls(self) -> int:
        return sum(hook.calls for hook in self.hooks.values())

    @property
    def cpu_s(self) -> float:
        return sum(hook.cpu_s for hook in self.hooks.values())

    @property
    def cpu_share(self) -> float:
        """The thread's CPU spent inside the hooks, over all the CPU it used (0 when it used none)."""
        return self.cpu_s / self.thread_cpu_s if self.thread_cpu_s else 0.0

    @property
    def mean_blocked_s(self) -> float:
        return sum(hook.blocked_s for hook in self.hooks.values()) / self.calls if self.calls else 0.0

    @property
    def max_blocked_s(self) -> float:
        return max((hook.max_blocked_s for hook in self.hooks.values()), default=0.0)

    @property
    def most_blocked(self) -> str:
        """The hook of the longest blocked call ("" when none was called): a wait for the
        interpreter lock is a few switch intervals (5 ms each), a synchronous load's much longer."""
        return max(self.hooks, key=lambda name: self.hooks[name].max_blocked_s, default="")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the engine process answers with it, the bench's record keeps it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HookReport:
        hooks = {name: HookTime(**hook) for name, hook in data["hooks"].items()}
        return cls(thread_cpu_s=float(data["thread_cpu_s"]), hooks=hooks)


class _ThreadState(threading.local):
    """Per calling thread: whether it is inside a hook, and its own schedstat reader."""

    def __init__(self) -> None:
        self.inside = False
        self.scheduled = ScheduledTime()


class HookClock:
    """Totals per hook, on the clocks of whichever thread calls it.

    A hook called from inside another (kvpipe's ``get_finished`` asks its
    ``get_transfer_results``) is the outer call's time: counting it again would
    count its time twice.
    """

    def __init__(self) -> None:
        self._hooks: dict[str, HookTime] = {}
        self._state = _ThreadState()
        self._lock = threading.Lock()  # hooks of several threads may add at once
        self._since_cpu_s = time.thread_time()

    def call(self, name: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)``, timed as hook ``name``: its answer or its exception, unchanged.

        :raises OSError: the calling thread's first hook, where there is no schedstat (not Linux).
        """
        state = self._state
        if state.inside:
            return method(*args, **kwargs)
        # the clocks read outermost first, so the cheap ones' reads are all that lands inside
        scheduled = state.scheduled.seconds()
        cpu = time.thread_time()
        wall = time.perf_counter()
        state.inside = True
        try:
            return method(*args, **kwargs)
        finally:
            wall = time.perf_counter() - wall
            cpu = time.thread_time() - cpu
            scheduled = state.scheduled.seconds() - scheduled
            state.inside = False
            # the scheduled span encloses the wall one by a few reads: never below 0
            self._add(name, cpu, wall, max(0.0, wall - scheduled))

    def _add(self, name: str, cpu_s: float, wall_s: float, blocked_s: float) -> None:
        with self._lock:
            hook = self._hooks.setdefault(name, HookTime())
            hook.calls += 1
            hook.cpu_s += cpu_s
            hook.wall_s += wall_s
            hook.blocked_s += blocked_s
            hook.max_blocked_s = max(hook.max_blocked_s, blocked_s)

    def take(self) -> HookReport:
        """The hooks' times since the last take (the first: since the clock was made), and start afresh.

        ``thread_cpu_s`` is the calling thread's CPU over the same span: call it on
        the thread that calls the hooks (the engine's), or the share means nothing.
        """
        now = time.thread_time()
        with self._lock:
            hooks, self._hooks = self._hooks, {}
        report = HookReport(thread_cpu_s=now - self._since_cpu_s, hooks=hooks)
        self._since_cpu_s = now
        return report


def timed_hooks(clock: HookClock, hooks: Iterable[str]) -> Callable[[T], T]:
    """A class decorator: each of ``hooks`` (methods, own or inherited) times itself on ``clock``.

    :raises AttributeError: a hook the class has no method of (a renamed hook fails loudly).
    """

    def decorate(cls: T) -> T:
        for name in hooks:
            setattr(cls, name, _timed(clock, name, getattr(cls, name)))
        return cls

    return decorate


def _timed(clock: HookClock, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        return clock.call(name, method, *args, **kwargs)

    return timed
