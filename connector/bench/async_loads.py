"""vllm-loads: what a load costs the requests that are already running: sync, async, async niced.

The 8-layer dummy Llama (2 MiB per stored object), one engine at a time in this
process, vLLM's in-process mode (so no other engine's threads compete for the 2
cores), on a spawned master. Per round and load mode:

1. a family of ``LOADERS`` prompts sharing one ``SHARED``-token prefix is stored,
   then vLLM's prefix cache is reset, so the prefix must come back from the store;
2. ``RUNNING`` short requests start decoding; after ``WARM_STEPS`` engine steps
   the loaders arrive; the engine steps until every request is done.

The modes (:data:`MODES`): sync loads; async loads; async loads whose pipeline runs
10 nicer than the engine (``load_nice``), which trades the loaders' first token for
the decode steps beside them. Figures: the decode-step time of the running requests (each engine step while
they decode and a loader waits for its first token, p50 and p99) against the
same steps with no loaders; the loaders' time to first token; and how many loads
the shared prefix cost (kvpipe's one load per shared prefix: 1).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvpipe.connector.engines import launch
from kvpipe.connector.store.mooncake.master import LocalMaster

from .result import BenchOptions, Target, WorkloadResult
from .vllm_prefix import BIGGER

SHARED = 1024
LOADERS = 4
RUNNING = 4
RUNNING_TOKENS = 64
DECODE_TOKENS = 96
WARM_STEPS = 6


@dataclass
class Round:
    """One mode's measurement: per-step times and the loaders' first tokens."""

    during: list[float]  # steps with a loader still waiting for its first token
    quiet: list[float]  # steps of the same requests with no loader
    ttft: list[float]
    loads: int


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1024) for _ in range(SHARED)]
    loaders = [shared + [rng.randrange(1024) for _ in range(64)] for _ in range(LOADERS)]
    running = [[rng.randrange(1024) for _ in range(RUNNING_TOKENS)] for _ in range(RUNNING)]
    return loaders, running


#: per load mode, the connector's settings: sync loads, async ones, and async ones a share of the CPU
MODES: dict[str, dict[str, Any]] = {
    "sync": {"load_async": False},
    "async": {"load_async": True},
    "async, load_nice 10": {"load_async": True, "load_nice": 10},
}


@contextmanager
def _engine(master: LocalMaster, settings: dict[str, Any]) -> Iterator[Any]:
    assert master.endpoints is not None
    extra = {"store": launch.store_section(master.endpoints), **settings}
    transfer = launch.kvpipe_transfer(extra, load_failure_policy="recompute")
    llm = launch.make_llm(
        launch.model_dir(BIGGER.name, BIGGER.config),
        transfer,
        max_model_len=2048,
        kv_cache_memory_bytes=BIGGER.kv_cache_memory_bytes,
    )
    try:
        yield llm
    finally:
        launch.close_llm(llm)


def _steps(
    llm: Any, running: list[list[int]], loaders: list[list[int]] | None
) -> tuple[list[float], list[float], list[float]]:
    """Step the engine: the running requests, then (after WARM_STEPS) the loaders.

    Returns the times of the steps that ran while a load was in flight (async:
    any step from the one that sent it to the one that saw it end; sync: the
    step that waited for it), the other steps, and each loader's time to first token.
    """
    engine = llm.llm_engine
    decode, first = launch.greedy(DECODE_TOKENS), launch.greedy(4)
    for index, prompt in enumerate(running):
        engine.add_request(f"run-{index}", {"prompt_token_ids": prompt}, decode)
    waiting: dict[str, float] = {}
    ttft: list[float] = []
    during: list[float] = []
    quiet: list[float] = []
    step = 0
    scheduler, worker = launch.sides(llm)
    while engine.has_unfinished_requests():
        if loaders is not None and step == WARM_STEPS:
            for index, prompt in enumerate(loaders):
                rid = f"load-{index}"
                engine.add_request(rid, {"prompt_token_ids": prompt}, first)
                waiting[rid] = time.perf_counter()
        loads_before, in_flight = worker.stats["loads"], scheduler.loads_in_flight
        started = time.perf_counter()
        outputs = engine.step()
        took = time.perf_counter() - started
        # a load ran during the step: it was in flight when the step began, went out
        # in it (async: it may have ended in it too; sync: the step waited for it),
        # or is still in flight after it
        loading = in_flight > 0 or worker.stats["loads"] > loads_before or scheduler.loads_in_flight > 0
        if step > WARM_STEPS // 2:  # past the running requests' own prefill
            (during if loading else quiet).append(took)
        for output in outputs:
            if output.request_id in waiting and output.outputs and output.outputs[0].token_ids:
                ttft.append(time.perf_counter() - waiting.pop(output.request_id))
        step += 1
    return during, quiet, ttft


def _round(master: LocalMaster, settings: dict[str, Any], seed: int) -> Round:
    loaders, running = _prompts(seed)
    with _engine(master, settings) as llm:
        launch.generate(llm, loaders, 1)  # store the family's prefix (and their own chunks)
        _, worker = launch.sides(llm)
        assert worker.drain(30.0)
        _, baseline, _ = _steps(llm, running, None)  # the same decode, no loader
        assert llm.reset_prefix_cache()
        loads_before = worker.stats["loads"]
        during, _, ttft = _steps(llm, running, loaders)
        loads = worker.stats["loads"] - loads_before
    return Round(during, baseline, ttft, loads)


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2) if ordered else 0.0


def run(options: BenchOptions) -> WorkloadResult:
    # One process: the step loop reads the connector's own state (loads in flight), and
    # the engine core steps in this thread, so a step's time is the step's own.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    rounds = 1 if options.quick else 4
    rows: list[dict[str, Any]] = []  # a table's cells, as WorkloadResult holds them
    measured: dict[str, list[Round]] = {mode: [] for mode in MODES}
    names = list(MODES)
    with LocalMaster() as master:
        assert master.endpoints is not None
        with launch.segment_holder(master.endpoints, BIGGER.segment_size):
            for index in range(rounds):
                shift = index % len(names)  # each mode goes first in turn
                for mode in names[shift:] + names[:shift]:
                    measured[mode].append(_round(master, MODES[mode], seed=1000 + 10 * index))
    for mode, results in measured.items():
        during = [t for r in results for t in r.during]
        quiet = [t for r in results for t in r.quiet]
        ttft = [t for r in results for t in r.ttft]
        rows.append(
            {
                "loads": mode,
                "decode p50 ms (loading)": _ms(during, 0.5),
                "decode p99 ms (loading)": _ms(during, 0.99),
                "decode p50 ms (no loads)": _ms(quiet, 0.5),
                "decode p99 ms (no loads)": _ms(quiet, 0.99),
                "TTFT p50 ms": _ms(ttft, 0.5),
                "loads per shared prefix": statistics.median(r.loads for r in results),
            }
        )
    sync, async_, _ = rows
    return WorkloadResult(
        workload="vllm-loads",
        description=(
            f"8x512 dummy Llama, {RUNNING} requests decoding while {LOADERS} requests sharing a stored "
            f"{SHARED}-token prefix arrive; {rounds} rounds per mode, each mode first in turn"
        ),
        columns=list(rows[0]),
        rows=rows,
        targets=[
            Target(
                name="async decode p99 / no loads",
                measured=round(
                    async_["decode p99 ms (loading)"] / max(async_["decode p99 ms (no loads)"], 1e-9), 2
                ),
                goal=1.2,
                op="<=",
            ),
            Target(
                name="async TTFT / sync TTFT",
                measured=round(async_["TTFT p50 ms"] / max(sync["TTFT p50 ms"], 1e-9), 2),
                goal=1.0,
                op="<=",
            ),
            Target(
                name="async loads per shared prefix",
                measured=async_["loads per shared prefix"],
                goal=1,
                op="<=",
            ),
        ],
        parameters={"rounds": rounds, "shared_tokens": SHARED, "loaders": LOADERS, "running": RUNNING},
    )
