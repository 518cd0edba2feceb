"""The ``vllm`` workload: the real engine on prefix-heavy prompts, store then reload.

Each round, every contender runs the round's fresh prompts: pass 1 (nothing stored
yet: it computes and its connector stores), then, once the stores have settled,
vLLM's own prefix cache is reset before each pass 2 (what is reused must come from
the connector), and last a warm pass without a reset (everything in vLLM's own cache:
what a reload is held to, ``reload_vs_warm``). Contenders:

- no connector: pass 2 recomputes, helped only by vLLM's own prefix cache within it;
- vLLM's ``MooncakeStoreConnector``;
- kvpipe's ``KVPipeConnector`` (every object sealed, every load verified);
- kvpipe with ``integrity: off``: what seals cost, side by side.

Each engine is a process of its own (:mod:`.vllm_engine`), all up at once, taking
turns pass by pass (the order rotates at every turn) so the machine's slow moments
spread over all of them. On the tiny model a pass 2 is ~0.1 s, which other work on
a shared machine easily doubles, so each round repeats it (the store is unchanged,
the reset comes again) for more samples. A first, small round (the quick workload's
prompts) warms every engine and path up (first kernels, the first store
connections) and is not counted.
Each connector has its own master on loopback and its own segment holder (this
process), the engines being pure clients, so every put and get crosses TCP, and its
store is emptied after every round, so no round or contender sees another's objects.

Hit tokens are counted from vLLM's own figures: the pass's prompt tokens served from
cache (``num_cached_tokens`` summed) minus what the no-connector engine's prefix
cache serves on the same pass, i.e. the prompt tokens the connector spared from
recompute. That is the honest measure across connectors that load differently:
vLLM's connector loads asynchronously, so requests sharing a system prompt each
load their own copy (``vllm:external_prefix_cache_hits`` counts every copy); kvpipe
loads synchronously, so the first request's loaded blocks enter vLLM's prefix cache
in the same step and the others hit them there (counted as local hits). The table
shows both counters too.

kvpipe's engines load its connector with every hook timed (:mod:`.vllm_timed`), which
answers what a wall-time ratio on shared cores cannot: how much of the engine
thread's own CPU (its ``thread_time``, over the counted rounds, every step and
reset included) goes inside kvpipe's hooks, and how long a hook call sleeps
(blocked: wall minus on-CPU minus run-queue time; the interpreter lock while
kvpipe's threads run Python, a lock, I/O). The engine is in-process, so the
scheduler's hooks, the worker's and the model all run on that one thread; torch's
intra-op threads are not in the denominator, which makes the share an upper bound.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpipe.connector.engines.launch import (
    TINY_LLAMA,
    kvpipe_transfer,
    model_dir,
    mooncake_transfer,
    segment_holder,
    store_section,
    stored_keys,
    vllm_mooncake_config,
    vllm_mooncake_env,
)
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster, MasterEndpoints

from .hook_clock import HookReport
from .plot import bar_plot
from .result import BenchOptions, Target, WorkloadResult
from .vllm_engine import EngineProcess

NONE, VLLM, KVPIPE = "no connector", "vLLM MooncakeStoreConnector", "kvpipe"
KVPIPE_UNSEALED = "kvpipe, integrity off"
CONTENDERS = (NONE, VLLM, KVPIPE, KVPIPE_UNSEALED)
BAR_LABELS = {
    NONE: "no connector",
    VLLM: "vLLM's connector",
    KVPIPE: "kvpipe",
    KVPIPE_UNSEALED: "kvpipe, no seals",
}
VOCAB = 1024
BLOCK = 128  # vLLM's default block size on CPU: tokens per stored chunk
#: the contenders whose engines load kvpipe's connector with its hooks timed
TIMED = (KVPIPE, KVPIPE_UNSEALED)
#: :mod:`.vllm_timed`'s connector, named by strings: importing it imports vLLM, which
#: this process (it only spawns engines) has no use for
TIMED_CONNECTOR = ("kvpipe.connector.bench.vllm_timed", "TimedKVPipeConnector")
#: the hook vLLM calls once per scheduler step: the bench counts steps by it
STEP_HOOK = "build_connector_meta"
#: the engine thread's CPU inside kvpipe's hooks, at most, on the 8x512 model (issue 25)
HOOK_CPU_SHARE_LIMIT = 0.02


@dataclass(frozen=True)
class Workload:
    """Prefix-heavy prompts: ``requests`` share ``system_prompts`` system prompts round-robin."""

    system_prompts: int
    system_tokens: int
    requests: int
    user_tokens: tuple[int, int]
    max_tokens: int

    def prompts(self, seed: int) -> list[list[int]]:
        """The round's prompts: fresh random tokens, so no round reuses another's prefixes."""
        rng = random.Random(seed)
        systems = [
            [rng.randrange(VOCAB) for _ in range(self.system_tokens)] for _ in range(self.system_prompts)
        ]
        return [
            systems[i % self.system_prompts]
            + [rng.randrange(VOCAB) for _ in range(rng.randint(*self.user_tokens))]
            for i in range(self.requests)
        ]

    @property
    def max_model_len(self) -> int:
        return self.system_tokens + self.user_tokens[1] + self.max_tokens


@dataclass(frozen=True)
class Model:
    """A dummy-weight model and what its engine needs."""

    label: str
    name: str  # the folder name: the model part of every store key
    config: Mapping[str, Any]
    kv_cache_memory_bytes: int
    segment_size: str  # the holder's segment: one round's objects, with room to spare
    pass1_limit: float  # what saving may cost the pass that saves (issue 14: saving is free)


TINY = Model("tiny", "tiny-llama", TINY_LLAMA, 128 << 20, "256MB", pass1_limit=1.10)
#: 8 layers, hidden 512 (8 heads of 64, no GQA): 256 KiB per block per layer, 2 MiB per
#: stored object. Recomputing a 1024-token prefix costs ~0.3 s of compute here, loading
#: its 16 MiB over loopback ~0.02 s: the case a KV cache store is for.
BIGGER = Model(
    "8x512",
    "llama-8x512",
    {
        **TINY_LLAMA,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
    },
    512 << 20,
    "1GB",
    pass1_limit=1.03,
)

FULL = Workload(system_prompts=8, system_tokens=1024, requests=32, user_tokens=(64, 192), max_tokens=4)
QUICK = Workload(system_prompts=2, system_tokens=512, requests=8, user_tokens=(32, 96), max_tokens=4)
#: rounds on the bigger model at most: one costs ~25 s of compute for the four contenders
BIGGER_ROUNDS = 4
#: passes 2 per round on the tiny model (~0.1-0.2 s each)
TINY_PASS2_REPEATS = 3


@dataclass(frozen=True)
class Plan:
    """How much to measure on one model."""

    model: Model
    rounds: int
    pass2_repeats: int = 1


@dataclass
class Passes:
    """One contender's passes as its engine process reported them, in the order of the turns.

    Every contender's lists line up: entry ``i`` of two contenders ran the same prompts.
    ``warm`` holds one pass per round run right after the round's last pass 2 without a
    reset: every prefix in vLLM's own cache, the limit a reload is held to.
    """

    pass1: list[Mapping[str, Any]] = field(default_factory=list)
    pass2: list[Mapping[str, Any]] = field(default_factory=list)
    warm: list[Mapping[str, Any]] = field(default_factory=list)

    def reload_vs_warm(self) -> float:
        """The median over rounds of the round's last pass 2 (after a reset) over its warm pass."""
        repeats = len(self.pass2) // len(self.warm)
        last = self.pass2[repeats - 1 :: repeats]
        # float(): a pass is a JSON record from the engine's process, untyped
        return statistics.median(
            float(r["seconds"] / w["seconds"]) for r, w in zip(last, self.warm, strict=True)
        )


def run(options: BenchOptions) -> WorkloadResult:
    workload = QUICK if options.quick else FULL
    plans = (
        [Plan(TINY, rounds=1)]
        if options.quick
        else [
            Plan(TINY, options.repeats, TINY_PASS2_REPEATS),
            Plan(BIGGER, min(options.repeats, BIGGER_ROUNDS)),
        ]
    )
    rows: list[dict[str, Any]] = []
    targets: list[Target] = []
    plots: list[str] = []
    pass2_samples: dict[str, dict[str, list[float]]] = {}
    idle_cpu: dict[str, dict[str, float]] = {}
    hook_times: dict[str, dict[str, Any]] = {}
    hook_lines: list[str] = []
    warm_up = None if options.quick else QUICK
    with tempfile.TemporaryDirectory(prefix="kvpipe-bench-vllm-") as scratch:
        for plan in plans:
            model = plan.model
            measured, idle, hooks = _measure(plan, workload, warm_up=warm_up, scratch=Path(scratch))
            hook_times[model.label] = {name: report.as_dict() for name, report in hooks.items()}
            hook_lines += [hooks_line(f"{model.label} {name}", report) for name, report in hooks.items()]
            idle_cpu[model.label] = {
                "share_of_a_core": round(idle.share(), 4),
                "timed_s": round(idle.timed_s, 2),
                **{BAR_LABELS[name]: round(cpu, 3) for name, cpu in idle.cpu_s.items()},
            }
            model_rows = _rows(model, measured)
            pass2_samples[model.label] = {
                name: [p["seconds"] for p in measured[name].pass2] for name in CONTENDERS
            }
            rows.extend(model_rows)
            targets.extend(_targets(model, {row["contender"]: row for row in model_rows}, measured, hooks))
            path = options.out_dir / f"vllm-{model.label}.png"
            bar_plot(
                path,
                f"vLLM, {model.label} model: pass 2 (after a prefix-cache reset)",
                "seconds (median)",
                {BAR_LABELS[row["contender"]]: row["pass2_s"] for row in model_rows},
            )
            plots.append(str(path))
    return WorkloadResult(
        workload="vllm",
        description=(
            f"the real vLLM engine, {workload.requests} requests over {workload.system_prompts} shared "
            f"{workload.system_tokens}-token system prompts; pass 1 stores, vLLM's prefix cache is reset, "
            "pass 2 loads; a warm pass (no reset) follows. hit_tokens = pass-2 cached prompt tokens minus the "
            "no-connector engine's "
            "(what the connector spared from recompute); local_hits / connector_hits = vLLM's "
            "prefix_cache_hits / external_prefix_cache_hits counters in pass 2"
        ),
        columns=[
            "model",
            "contender",
            "pass1_s",
            "pass2_s",
            "pass2_vs_none",
            "warm_s",
            "reload_vs_warm",
            "cached_tokens",
            "local_hits",
            "connector_hits",
            "hit_tokens",
            "same_outputs",
        ],
        rows=rows,
        targets=targets,
        notes=[
            f"models: tiny = {_describe(TINY)}; {BIGGER.label} = {_describe(BIGGER)}"
            + (" (quick mode: tiny only)" if options.quick else ""),
            "times are medians over all passes (fresh prompts each round, contenders taking turns); "
            "pass2_vs_none and the pass-2 targets are medians of per-turn ratios (each pass 2 against the "
            "other's pass 2 of the same turn, run back to back); same_outputs: every pass's greedy tokens "
            "equal the no-connector engine's",
            "vLLM's connector loads one copy per request (async loads keep loaded blocks out of vLLM's "
            "prefix cache until they land); kvpipe loads one copy per prefix and vLLM's cache serves the rest",
            "while one engine's pass was timed, the idle engines used "
            + ", ".join(f"{label} {cpu['share_of_a_core']:.1%}" for label, cpu in idle_cpu.items())
            + " of one core (CPU seconds per engine in the JSON record: idle_engine_cpu)",
            *hook_lines,
        ],
        plots=plots,
        parameters={
            "quick": options.quick,
            "rounds": {plan.model.label: plan.rounds for plan in plans},
            "pass2_per_round": {plan.model.label: plan.pass2_repeats for plan in plans},
            "requests": workload.requests,
            "system_prompts": workload.system_prompts,
            "system_tokens": workload.system_tokens,
            "user_tokens": list(workload.user_tokens),
            "max_tokens": workload.max_tokens,
            "pass2_s_samples": pass2_samples,
            "idle_engine_cpu": idle_cpu,
            "hook_times": hook_times,
        },
    )


def _describe(model: Model) -> str:
    c = model.config
    return f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads"


@dataclass
class IdleCpu:
    """CPU the engines not being timed used while another one was: ~0, unless one spins.

    A pass time is only the contender's own if the others keep still meanwhile (on
    2 cores, one engine spinning halves the timed one's share).
    """

    cpu_s: dict[str, float] = field(default_factory=dict)  # per engine, while idle
    timed_s: float = 0.0  # wall time of every timed pass

    def share(self) -> float:
        """The idle engines' CPU as a fraction of one core over the timed passes."""
        return sum(self.cpu_s.values()) / self.timed_s if self.timed_s else 0.0


def timed_transfer(transfer: Mapping[str, Any]) -> dict[str, Any]:
    """A kvpipe ``kv_transfer_config`` (:func:`.launch.kvpipe_transfer`) loading the timed connector."""
    module, name = TIMED_CONNECTOR
    return {**transfer, "kv_connector": name, "kv_connector_module_path": module}


def hooks_line(label: str, report: HookReport) -> str:
    """The console's line for one engine's hook times (a note of the result)."""
    steps = report.hooks[STEP_HOOK].calls if STEP_HOOK in report.hooks else 0
    return (
        f"{label}: engine thread in kvpipe hooks: {report.cpu_share:.2%} of its CPU "
        f"({report.cpu_s * 1e3:.0f} ms of {report.thread_cpu_s:.2f} s over {steps} steps); "
        f"blocked (interpreter lock, locks, I/O) per hook call: mean {report.mean_blocked_s * 1e6:.0f} us, "
        f"max {report.max_blocked_s * 1e3:.2f} ms in {report.most_blocked} ({report.calls} calls)"
    )


def _measure(
    plan: Plan, workload: Workload, *, warm_up: Workload | None, scratch: Path
) -> tuple[dict[str, Passes], IdleCpu, dict[str, HookReport]]:
    """Every contender's passes on ``plan.model`` (the engines take turns pass by pass), and the
    timed engines' hook times over the counted rounds."""
    model = plan.model
    folder = model_dir(model.name, model.config, scratch / "models")
    base = {
        "model": str(folder),
        "max_model_len": workload.max_model_len,
        "kv_cache_memory_bytes": model.kv_cache_memory_bytes,
    }
    with ExitStack() as stack:
        kvpipe_store = stack.enter_context(_store(model.segment_size))
        unsealed_store = stack.enter_context(_store(model.segment_size))
        vllm_store = stack.enter_context(_store(model.segment_size))
        config_path = scratch / f"mooncake-{model.label}.json"
        config_path.write_text(json.dumps(vllm_mooncake_config(vllm_store.endpoints)))
        in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        kvpipe = timed_transfer(kvpipe_transfer({"store": store_section(kvpipe_store.endpoints)}))
        unsealed = timed_transfer(
            kvpipe_transfer({"store": store_section(unsealed_store.endpoints), "integrity": "off"})
        )
        specs = {
            NONE: ({**base, "transfer": None}, in_process),
            VLLM: (
                {**base, "transfer": mooncake_transfer()},
                {**in_process, **vllm_mooncake_env(config_path)},
            ),
            KVPIPE: ({**base, "transfer": kvpipe}, in_process),
            KVPIPE_UNSEALED: ({**base, "transfer": unsealed}, in_process),
        }
        # each in the stack as soon as it runs: an error or a signal stops every one started
        engines = {name: stack.enter_context(EngineProcess(spec, env)) for name, (spec, env) in specs.items()}
        for engine in engines.values():
            engine.wait_ready()
        stores = [kvpipe_store, unsealed_store, vllm_store]
        measured = {name: Passes() for name in CONTENDERS}
        idle = IdleCpu()
        schedule = [(workload.prompts(seed), plan.pass2_repeats, True) for seed in range(1, plan.rounds + 1)]
        if warm_up is not None:
            schedule.insert(0, (warm_up.prompts(seed=0), 1, False))
        first_counted = int(warm_up is not None)
        for index, (prompts, repeats, counted) in enumerate(schedule):
            if index == first_counted:
                _take_hook_times(engines)  # loading and warming up: not the counted rounds'
            command = {"generate": prompts, "max_tokens": workload.max_tokens}
            passes = _round(engines, stores, command, repeats, index, idle if counted else IdleCpu())
            if counted:
                for name, done in passes.items():
                    measured[name].pass1.extend(done.pass1)
                    measured[name].pass2.extend(done.pass2)
                    measured[name].warm.extend(done.warm)
            _progress(plan.model, index + (warm_up is None), len(schedule) - (warm_up is not None), passes)
        return measured, idle, _take_hook_times(engines)


def _take_hook_times(engines: Mapping[str, EngineProcess]) -> dict[str, HookReport]:
    """Each timed engine's hook times since the last take."""
    return {name: HookReport.from_dict(engines[name].call({"hook_times": True})) for name in TIMED}


def _progress(model: Model, number: int, rounds: int, passes: Mapping[str, Passes]) -> None:
    """One line per round on stderr, so a long run is visibly alive (round 0: the warm-up)."""
    timings = "; ".join(
        f"{BAR_LABELS[name]} {done.pass1[0]['seconds']:.2f} s / "
        f"{statistics.median(p['seconds'] for p in done.pass2):.2f} s"
        for name, done in passes.items()
    )
    label = "warm-up" if number == 0 else f"round {number}/{rounds}"
    print(f"-- vllm {model.label} {label}: pass 1 / pass 2 {timings}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _Store:
    endpoints: MasterEndpoints
    holder: MooncakeStore


@contextmanager
def _store(segment_size: str) -> Iterator[_Store]:
    """A fresh master and the client holding its memory: one connector's store."""
    with LocalMaster() as master:
        assert master.endpoints is not None
        with segment_holder(master.endpoints, segment_size) as holder:
            yield _Store(master.endpoints, holder)


def _round(
    engines: Mapping[str, EngineProcess],
    stores: Sequence[_Store],
    command: Mapping[str, Any],
    repeats: int,
    turn: int,
    idle: IdleCpu,
) -> dict[str, Passes]:
    """Pass 1 for everyone, the stores settle, ``repeats`` x (reset, pass 2), then a warm pass.

    The order of the contenders rotates at every turn. At the end vLLM's caches are
    reset and the stores emptied, so the next round starts from nothing.
    """
    passes = {name: Passes() for name in engines}
    for name in _turn(turn):
        passes[name].pass1.append(_timed(engines, name, command, idle))
    for store in stores:
        _settle(store.endpoints, at_least=_full_blocks(command["generate"]))
    for repeat in range(repeats):
        for name in _turn(turn + repeat):
            reset_prefix_cache(engines[name])
            passes[name].pass2.append(_timed(engines, name, command, idle))
    for name in _turn(turn):  # no reset: what the last pass 2 computed or loaded is cached
        passes[name].warm.append(_timed(engines, name, command, idle))
    for name in engines:
        reset_prefix_cache(engines[name])
    for store in stores:
        _settle(store.endpoints)
        store.holder.remove_all(force=True)
    return passes


def _timed(
    engines: Mapping[str, EngineProcess], name: str, command: Mapping[str, Any], idle: IdleCpu
) -> dict[str, Any]:
    """Engine ``name``'s pass, and what the others burnt meanwhile (into ``idle``)."""
    others = {other: engine.cpu_seconds() for other, engine in engines.items() if other != name}
    started = time.perf_counter()
    answer = engines[name].call(command)
    idle.timed_s += time.perf_counter() - started
    for other, before in others.items():
        idle.cpu_s[other] = idle.cpu_s.get(other, 0.0) + engines[other].cpu_seconds() - before
    return answer


def _turn(index: int) -> tuple[str, ...]:
    """The contenders in the order of turn ``index``: each goes first as often as the others."""
    turn = index % len(CONTENDERS)
    return CONTENDERS[turn:] + CONTENDERS[:turn]


def reset_prefix_cache(engine: EngineProcess) -> None:
    """Reset the engine's prefix cache, so that what it hits next is the connector's.

    :raises RuntimeError: vLLM refused (requests were still running).
    """
    if not engine.call({"reset": True})["reset"]:
        raise RuntimeError(
            "vLLM's prefix cache could not be reset: its next hits would not be the connector's"
        )


def _full_blocks(prompts: Sequence[Sequence[int]]) -> int:
    """Distinct full blocks of the prompts: the objects a connector stores in pass 1, at least."""
    return len({tuple(p[:end]) for p in prompts for end in range(BLOCK, len(p) + 1, BLOCK)})


def _settle(
    endpoints: MasterEndpoints, at_least: int = 0, quiet_s: float = 0.3, timeout_s: float = 30.0
) -> None:
    """Wait until the master holds ``at_least`` keys and their count stops growing.

    Both connectors save in the background: pass 2 must not start before pass 1's
    objects have landed, or it would measure a half-stored cache.
    """
    deadline = time.monotonic() + timeout_s
    count, since = len(stored_keys(endpoints)), time.monotonic()
    while (count < at_least or time.monotonic() - since < quiet_s) and time.monotonic() < deadline:
        time.sleep(0.05)
        now = len(stored_keys(endpoints))
        if now != count:
            count, since = now, time.monotonic()


def _rows(model: Model, measured: Mapping[str, Passes]) -> list[dict[str, Any]]:
    """One row per contender: medians over its passes, hits against the no-connector engine's."""
    reference = measured[NONE]
    rows = []
    for name in CONTENDERS:
        passes = measured[name]
        cached = [sum(p["cached"]) for p in passes.pass2]
        hits = [c - sum(n["cached"]) for c, n in zip(cached, reference.pass2, strict=True)]
        pairs = [
            *zip(passes.pass1, reference.pass1, strict=True),
            *zip(passes.pass2, reference.pass2, strict=True),
            *zip(passes.warm, reference.warm, strict=True),
        ]
        same = all(mine["tokens"] == theirs["tokens"] for mine, theirs in pairs)
        rows.append(
            {
                "model": model.label,
                "contender": name,
                "pass1_s": statistics.median(p["seconds"] for p in passes.pass1),
                "pass1_vs_none": _paired_ratio(passes, reference, "pass1"),
                "pass2_s": statistics.median(p["seconds"] for p in passes.pass2),
                "pass2_vs_none": _paired_ratio(passes, reference),
                "warm_s": statistics.median(p["seconds"] for p in passes.warm),
                "reload_vs_warm": passes.reload_vs_warm(),
                "cached_tokens": int(statistics.median(cached)),
                "local_hits": int(statistics.median(p["local_hits"] for p in passes.pass2)),
                "connector_hits": int(statistics.median(p["connector_hits"] for p in passes.pass2)),
                "hit_tokens": int(statistics.median(hits)),
                "same_outputs": same,
            }
        )
    return rows


def _paired_ratio(mine: Passes, theirs: Passes, which: str = "pass2") -> float:
    """The median over turns of my pass over theirs in the same turn (same prompts, back to back).

    ``which``: ``"pass1"`` or ``"pass2"``. A slow moment of the shared machine slows
    both passes of a turn, so their ratio holds where a ratio of medians would mix
    slow moments of one with quiet ones of the other.
    """
    pairs = zip(getattr(mine, which), getattr(theirs, which), strict=True)
    return statistics.median(float(m["seconds"] / t["seconds"]) for m, t in pairs)  # JSON records


def _targets(
    model: Model,
    rows: Mapping[str, Mapping[str, Any]],
    measured: Mapping[str, Passes],
    hooks: Mapping[str, HookReport],
) -> list[Target]:
    kvpipe, vllm = rows[KVPIPE], rows[VLLM]
    targets = [
        Target(
            name=f"{model.label}: kvpipe hit tokens / vLLM connector's",
            measured=kvpipe["hit_tokens"] / max(1, vllm["hit_tokens"]),
            goal=1.0,
            op=">=",
        ),
        Target(
            name=f"{model.label}: kvpipe outputs identical to no connector (1 = yes)",
            measured=float(kvpipe["same_outputs"]),
            goal=1.0,
            op=">=",
        ),
        Target(
            name=f"{model.label}: kvpipe pass 1 (saving) / no connector's",
            measured=kvpipe["pass1_vs_none"],
            goal=model.pass1_limit,
            op="<=",
        ),
        Target(
            name=f"{model.label}: kvpipe pass 2 after a reset / the same pass on a warm engine",
            measured=kvpipe["reload_vs_warm"],
            goal=1.3,
            op="<=",
        ),
    ]
    if model is TINY:
        targets += [
            Target(
                name="tiny: kvpipe pass 2 / vLLM connector's pass 2",
                measured=_paired_ratio(measured[KVPIPE], measured[VLLM]),
                goal=0.9,
                op="<=",
            ),
            Target(
                name="tiny: kvpipe pass 2 / no connector's (below 1: loading beats recomputing)",
                measured=kvpipe["pass2_vs_none"],
                goal=1.0,
                op="<=",
            ),
        ]
    else:
        targets += [
            Target(
                name=f"{model.label}: kvpipe pass 2 / no connector's (clearly faster)",
                measured=kvpipe["pass2_vs_none"],
                goal=0.7,
                op="<=",
            ),
            Target(
                name=f"{model.label}: engine thread's CPU inside kvpipe's hooks / all its CPU",
                measured=hooks[KVPIPE].cpu_share,
                goal=HOOK_CPU_SHARE_LIMIT,
                op="<=",
            ),
        ]
    targets.append(
        Target(
            name=f"{model.label}: kvpipe pass 2 (verified loads) / kvpipe's with integrity off",
            measured=_paired_ratio(measured[KVPIPE], measured[KVPIPE_UNSEALED]),
            goal=1.05,
            op="<=",
        )
    )
    return targets
