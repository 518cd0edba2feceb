"""The staging copy on a real accelerator: launches and engine-thread waits per step, and its GB/s.

``make gpu-check`` runs it (``python3 -m tests.connector.vllm.measure_staging_copy``) and
prints, per KV layout (each layer in an allocation of its own, as vLLM has them):
the copies a save step launches and the blocking waits on the engine thread, how
long ``copy_in`` holds the engine thread, and the save copy's GB/s against one
plain device-to-host copy of the same bytes (the transfer's ceiling). The save
pipeline's wait runs in a thread of its own, as it does in the connector.
Without an accelerator it says so and exits 0: the CPU proof is
``tests/connector/vllm/test_device_double.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from kvpipe.connector.vllm.device import AcceleratorDevice
from kvpipe.connector.vllm.kv_layout import group_layout
from kvpipe.connector.vllm.staging_area import StagingArea

from .device_double import CountingDevice
from .test_device_path import layout_views

#: 8 layers of 8 heads, 16 tokens of 256 bf16 (K and V of 128): 512 KiB a block
SHAPE = {"L": 8, "B": 1024, "H": 8, "N": 16, "C": 256}
STEP_BLOCKS = 256  # 128 MiB a step
REPEATS = 5


def _seconds(run: Callable[[], None]) -> float:
    """The best of ``REPEATS`` runs of ``run()`` (which returns once its copy is done)."""
    best = float("inf")
    for _ in range(REPEATS):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return best


def measure(name: str, device: torch.device) -> str:
    views = {layer: view.clone() for layer, view in layout_views(name, device.type, shape=SHAPE).items()}
    counted = CountingDevice(AcceleratorDevice(device))
    area = StagingArea({0: (group_layout(views, SHAPE["B"], name),)}, STEP_BLOCKS, counted)
    copies = [
        (0, slot, block) for block, slot in zip(range(0, SHAPE["B"], 4), area.take(STEP_BLOCKS), strict=True)
    ]
    engine = threading.current_thread().name
    held: list[float] = []

    def save_step() -> None:
        began = time.perf_counter()
        fence = area.copy_in(copies)
        held.append(time.perf_counter() - began)
        waiter = threading.Thread(target=fence.wait, name="save-pipeline")  # the pipeline's side
        waiter.start()
        waiter.join()

    save_step()  # warm: the side stream, the allocators
    launches, waits = counted.launches[engine], counted.waits[engine]
    staged = _seconds(save_step)
    nbytes = area.arena.numel()  # the step's slots
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def plain() -> None:
        target.copy_(source, non_blocking=True)
        torch.accelerator.synchronize(device)

    plain()
    ceiling = _seconds(plain)
    return (
        f"{name}: {len(copies)} blocks, {nbytes >> 20} MiB a step: {launches} launches, "
        f"{waits} engine-thread waits; copy_in holds the engine thread {min(held) * 1e3:.2f} ms; "
        f"save copy {nbytes / staged / 1e9:.1f} GB/s vs plain device-to-host {nbytes / ceiling / 1e9:.1f} GB/s"
    )


def main() -> None:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        print("measure_staging_copy: no accelerator here; nothing measured")
        return
    for name in ("LBHNC", "LHBNC", "BLHNC"):
        print(measure(name, accelerator), flush=True)


if __name__ == "__main__":
    main()
