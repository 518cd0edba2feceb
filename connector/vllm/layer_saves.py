"""A step's layer-wise saves: each layer copied into the staging slots as the forward completes it.

With ``save_layerwise`` the worker takes a step's save slots and submits its saves
when vLLM binds the step's metadata, before the forward; the put stage reserves
their objects (invisible) and waits. After each attention layer vLLM calls
``save_kv_layer``: the worker copies the layer's bytes of every block the step
saves into the slots (the copy thread, or a device's side stream) and tells the
saves that wave is readable once that copy is done; the put writes it while the
forward computes the next layer. At the step's end (``wait_for_save``) the
layers no hook announced (a mamba layer, a step vLLM ran without hooks) are
copied, and each save learns the step's verdict: a request whose load failed in
the step computed over bad blocks, so its save is called off and its objects
revoked, never seen; the others are sealed and made visible (:mod:`kvpipe.stages.put`).

:class:`StepLayers` is the step's side (the engine's thread tells it; the put's
thread waits on it); :class:`SaveLayers` is one save's view of it, the
:class:`~kvpipe.stages.model.LayerProgress` its records carry.
"""

from __future__ import annotations

import threading
import time

from kvpipe.stages.model import Wave

from .device import Fence


class StepLayers:
    """Which waves of a step's saves are copied (each with the fence of its copy), and whether the step ended."""

    def __init__(self, waves: tuple[Wave, ...]) -> None:
        self.waves = waves
        self._changed = threading.Condition()
        self._copied: list[Fence] = []  # per wave copied so far, in order
        self._ended = False

    @property
    def copied(self) -> int:
        """How many waves (from the first) have been copied into the slots."""
        return len(self._copied)

    def landed(self, fence: Fence) -> None:
        """The next wave's copy was started; ``fence`` is done once it is readable (the engine's thread)."""
        with self._changed:
            self._copied.append(fence)
            self._changed.notify_all()

    def end(self) -> None:
        """The step's forward is over and every wave was copied: each save learns its verdict."""
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait(self, step: int, timeout_s: float) -> bool:
        """Until wave ``step`` is readable (or, past the last wave, the step ended): whether in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            if not self._changed.wait_for(
                lambda: self._ended if step >= len(self.waves) else len(self._copied) > step,
                max(0.0, deadline - time.monotonic()),
            ):
                return False
            if step >= len(self.waves):
                return True
            fence = self._copied[step]
        fence.wait()  # outside the lock: the engine's thread goes on telling waves meanwhile
        return True


class SaveLayers:
    """One save of a step: the step's waves, and its own verdict (:class:`~kvpipe.stages.model.LayerProgress`)."""

    def __init__(self, step: StepLayers) -> None:
        self._step = step
        self._called_off = threading.Event()

    @property
    def waves(self) -> tuple[Wave, ...]:
        return self._step.waves

    def call_off(self) -> None:
        """Its request's load failed in the step: nothing it computed may be stored."""
        self._called_off.set()

    def wait(self, step: int, timeout_s: float) -> bool:
        if self._called_off.is_set():
            return False
        landed = self._step.wait(step, timeout_s)
        return landed and not self._called_off.is_set()
