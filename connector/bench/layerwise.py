"""vllm-layerwise: layer-wise loads and saves against whole ones, on the 8-layer model.

The 8-layer dummy Llama (2 MiB per stored object, a context of up to 16k tokens),
one engine at a time in this process (vLLM's in-process mode, so no other
engine's threads compete for the cores), each a pure client of a spawned master
whose segment this process holds, so every transfer crosses TCP. Per prompt
length (:data:`LENGTHS`; ``--quick``: the first) and engine, each repeat takes a
fresh prompt and:

1. sends it for one token: the engine computes it and saves it; the save's
   *landing* is the time from the end of the forward that computed a chunk to
   the chunk stored (the worker's landings: a whole save is submitted when the
   forward ends, a layer-wise one before it starts);
2. resets vLLM's prefix cache and sends it again: the *reload TTFT*, every whole
   block from the store;
3. (the sync engine) sends it once more without the reset: the *local hit*, every
   whole block in vLLM's own cache, what a reload is held to.

Engines (:data:`ENGINES`): sync loads and whole saves; async loads (even on an idle
engine, ``load_sync_when_idle: false``); layer-wise loads and saves; and sync and
layer-wise loads straight into the CPU cache's blocks (``load_via_staging: false``:
no copy home from the staging slots, which a layer-wise load makes on the engine's
thread between layers). A layer-wise engine's last reload at each length leaves its
*timeline*: per layer, when the forward reached it, when its bytes had landed, when
its attention could start.

Before the engines, the store alone: the longest prompt's objects read a layer at a time,
one ranged get per layer as a layer-wise load reads them, with nothing else running: what a
layer's transfer costs when it does not share the cores with a forward.

On 2 shared cores a layer's transfer (the store's threads, the copy home) and the
forward's compute take turns on the same cores, so overlap buys little here; the
timeline shows where the time goes, and docs/layerwise.md what a GPU changes.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvpipe.connector.engines import launch
from kvpipe.connector.store.mooncake.master import LocalMaster
from kvpipe.connector.vllm.metrics import SAVE_LANDING_SECONDS

from .result import BenchOptions, Target, WorkloadResult
from .vllm_prefix import BIGGER

#: the prompt lengths, in tokens (whole blocks of 128 and a few more)
LENGTHS = (1024, 4096, 16384)
EXTRA_TOKENS = 16
#: the 8x512 model with room for the longest prompt (a model folder of its own)
MODEL_CONFIG = {**BIGGER.config, "max_position_embeddings": LENGTHS[-1] + 256}
MAX_MODEL_LEN = LENGTHS[-1] + 128
KV_CACHE_BYTES = 768 << 20  # the longest prompt's 256 MiB, with room
SEGMENT = "2GB"
#: staging slots: a 16k-token prompt's 128 objects, and a step's saves beside them
STAGING_BLOCKS = 160

LAYERWISE = {"load_async": False, "load_layerwise": True, "save_layerwise": True}
#: through the staging slots (the default, and a device cache's only way), then straight into
#: the CPU cache's blocks: a layer-wise load's copy home runs on the engine's thread between layers
ENGINES: dict[str, dict[str, Any]] = {
    "sync": {"load_async": False},
    "async": {"load_async": True, "load_sync_when_idle": False},
    "layer-wise": LAYERWISE,
    "sync, in place": {"load_async": False, "load_via_staging": False},
    "layer-wise, in place": {**LAYERWISE, "load_via_staging": False},
}


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1024) for _ in range(length + EXTRA_TOKENS)]


@contextmanager
def _engine(master: LocalMaster, settings: dict[str, Any]) -> Iterator[Any]:
    assert master.endpoints is not None
    extra = {"store": launch.store_section(master.endpoints), "staging_blocks": STAGING_BLOCKS, **settings}
    llm = launch.make_llm(
        launch.model_dir("llama-8x512-16k", MODEL_CONFIG),
        launch.kvpipe_transfer(extra, load_failure_policy="recompute"),
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    try:
        yield llm
    finally:
        launch.close_llm(llm)


def _timed(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """One pass of ``prompt`` for one token: its seconds and the tokens it found cached."""
    started = time.perf_counter()
    result = launch.generate(llm, [prompt], 1)
    return time.perf_counter() - started, result.cached[0]


def _measure(llm: Any, name: str, length: int, repeats: int, seed: int) -> dict[str, Any]:
    """One engine at one length: its landings, reload TTFTs, local hits (sync), and a layer-wise timeline."""
    _, worker = launch.sides(llm)
    rng = random.Random(seed)
    landings: list[float] = []
    reloads: list[float] = []
    local: list[float] = []
    reloaded_tokens: list[int] = []
    timeline: list[Any] = []
    for _ in range(repeats):
        prompt = _prompt(rng, length)
        worker.take_samples()  # what earlier passes left
        _timed(llm, prompt)
        assert worker.drain(60.0), "the saves did not land within 60 s"
        landings.extend(worker.take_samples().get(SAVE_LANDING_SECONDS, []))
        assert llm.reset_prefix_cache()
        worker.take_layer_timeline()  # only this reload's
        seconds, cached = _timed(llm, prompt)
        timeline = worker.take_layer_timeline()
        reloads.append(seconds)
        reloaded_tokens.append(cached)
        if name == "sync":
            local.append(_timed(llm, prompt)[0])
    return {
        "landing": landings,
        "reload": reloads,
        "local": local,
        "cached": min(reloaded_tokens),
        "timeline": timeline,
    }


#: the store alone: the longest prompt's objects (8 layers of 256 KiB each), read a layer at a time
RANGED_OBJECTS = LENGTHS[-1] // 128
RANGED_WAVES = 8
RANGED_OBJECT_BYTES = 2 << 20


def _ranged_gets(master: LocalMaster, repeats: int) -> list[float]:
    """Seconds to read :data:`RANGED_OBJECTS` objects a layer at a time, one ranged get per layer, as a
    layer-wise load reads them, with nothing else running: what a layer's transfer costs on free cores."""
    assert master.endpoints is not None
    keys = [f"kvpipe-bench-ranged-{index}" for index in range(RANGED_OBJECTS)]
    wave = RANGED_OBJECT_BYTES // RANGED_WAVES
    source = torch.randint(0, 255, (RANGED_OBJECTS * RANGED_OBJECT_BYTES,), dtype=torch.uint8)
    landing = torch.zeros_like(source)
    addresses = [RANGED_OBJECT_BYTES * index for index in range(RANGED_OBJECTS)]
    seconds: list[float] = []
    with launch.segment_holder(master.endpoints, 0) as client:
        for memory in (source, landing):
            assert client.register_buffer(memory.data_ptr(), memory.numel()) == 0
        codes = client.batch_put_from_multi_buffers(
            keys,
            [[source.data_ptr() + at] for at in addresses],
            [[RANGED_OBJECT_BYTES]] * RANGED_OBJECTS,
            client.new_replicate_config(),
        )
        assert codes == [0] * RANGED_OBJECTS, codes
        for _ in range(repeats + 1):  # the first: connections
            assert client.batch_get_session_start(keys) == [0] * RANGED_OBJECTS
            started = time.perf_counter()
            for layer in range(RANGED_WAVES):
                codes = client.batch_get_into_multi_buffer_ranges(
                    keys,
                    [[landing.data_ptr() + at + layer * wave] for at in addresses],
                    [[wave]] * RANGED_OBJECTS,
                    [[layer * wave]] * RANGED_OBJECTS,
                )
                assert codes == [wave] * RANGED_OBJECTS, codes
            seconds.append(time.perf_counter() - started)
            client.batch_get_session_end(keys)
        assert torch.equal(source, landing)
        for key in keys:
            client.remove(key, force=True)
    return seconds[1:]


def _ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 1) if values else float("nan")


def _timeline_rows(timeline: list[Any]) -> list[str]:
    """The timeline as markdown rows: per layer, from the forward reaching layer 0."""
    if not timeline:
        return []
    start = timeline[0].asked
    rows = ["| layer | reached ms | bytes in ms | attention from ms | waited ms |", "|---|---|---|---|---|"]
    for wait in timeline:
        landed = "-" if wait.landed is None else f"{1000 * (wait.landed - start):.1f}"
        rows.append(
            f"| {wait.layer} | {1000 * (wait.asked - start):.1f} | {landed} | "
            f"{1000 * (wait.returned - start):.1f} | {1000 * (wait.returned - wait.asked):.1f} |"
        )
    return rows


def run(options: BenchOptions) -> WorkloadResult:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine steps in this thread: its hooks are ours
    lengths = LENGTHS[:1] if options.quick else LENGTHS
    repeats = 1 if options.quick else 3
    found: dict[tuple[str, int], dict[str, Any]] = {}
    with LocalMaster() as master:
        assert master.endpoints is not None
        with launch.segment_holder(master.endpoints, SEGMENT):
            alone = _ranged_gets(master, repeats)
            for index, (name, settings) in enumerate(ENGINES.items()):
                with _engine(master, settings) as llm:
                    _timed(llm, _prompt(random.Random(index), 256))  # first kernels, first connections
                    for length in lengths:
                        found[(name, length)] = _measure(llm, name, length, repeats, seed=100 * index + length)
    rows: list[dict[str, Any]] = []
    targets: list[Target] = []
    notes: list[str] = [
        f"the store alone, {RANGED_OBJECTS} objects of {RANGED_OBJECT_BYTES >> 20} MiB read a layer at a time "
        f"({RANGED_WAVES} ranged gets) with nothing else running: {_ms(alone)} ms, "
        f"{_ms(alone) / RANGED_WAVES:.1f} ms a layer"
    ]
    for length in lengths:
        sync, layered = found[("sync", length)], found[("layer-wise", length)]
        local_ms = _ms(sync["local"])
        for name in ENGINES:
            measured = found[(name, length)]
            rows.append(
                {
                    "tokens": length,
                    "engine": name,
                    "reload TTFT p50 ms": _ms(measured["reload"]),
                    "local hit p50 ms": local_ms if name == "sync" else "-",
                    "reloaded tokens": measured["cached"],
                    "save landing p50 ms": _ms(measured["landing"]) if name in ("sync", "layer-wise") else "-",
                }
            )
        ratio = _ms(layered["reload"]) / max(_ms(sync["reload"]), 1e-9)
        if length >= 4096:
            targets.append(
                Target(name=f"layer-wise / sync reload TTFT, {length}", measured=round(ratio, 2), goal=0.8, op="<=")
            )
            targets.append(
                Target(
                    name=f"layer-wise reload / local hit, {length}",
                    measured=round(_ms(layered["reload"]) / max(local_ms, 1e-9), 2),
                    goal=1.2,
                    op="<=",
                )
            )
        for name in ("layer-wise", "layer-wise, in place"):
            notes.append(f"{name} reload timeline, {length} tokens (ms from the forward reaching layer 0):")
            notes.extend(_timeline_rows(found[(name, length)]["timeline"]))
    return WorkloadResult(
        workload="vllm-layerwise",
        description=(
            f"8x512 dummy Llama, one prompt of each length at a time, {repeats} repeats per engine and "
            "length: stored, then reloaded after vLLM's prefix cache is reset (sync, async, layer-wise), "
            "and a local hit; the saves' landing after the forward, whole against layer-wise"
        ),
        columns=list(rows[0]),
        rows=rows,
        targets=targets,
        notes=notes,
        parameters={"lengths": list(lengths), "repeats": repeats, "staging_blocks": STAGING_BLOCKS},
    )
