"""``capacity-engine``: the ``capacity`` workload's targeted point, through the real vLLM engine.

:mod:`.capacity` replays a skewed trace against a real store with each connector's
store calls re-enacted; this runs the same trace (Zipf s=1.0 over 40 shared
prefixes, half the requests one-off documents) through real engines with the real
connectors, so whatever a replay leaves out (scheduling, async loads and saves,
vLLM's own block handling) is in. The tiny dummy Llama; a prefix is 8 KV blocks of
128 tokens, each request adds one block of tokens of its own and asks for one output
token. Each connector's engine lends its store all of the store's memory, half the
bytes of the 40 prefixes' KV (reckoned from the model's bytes per token), on a
master of its own with Mooncake's default leases: every contender starts from an
empty store of the same size.

``lent_by="store node"`` (``python -m kvpipe.connector.bench.capacity_engine --lent-by
store-node``) lays the stores out as fleets and disaggregated deployments do: a client
of its own (a store node) lends each master the memory and the engines lend none
(``global_segment_size: 0``, vLLM's ``standalone-store``). kvpipe's default pin budget
then comes from the store's capacity, read off the master's admin HTTP
(docs/retention.md); beside it runs kvpipe with the budget the old rule gave such an
engine (0.9 of what it lends: nothing), in place of retention off.

Requests go in batches of :data:`~.capacity_replay.BATCH`; vLLM's prefix cache is
reset after every batch, so nothing outlives a batch but what the store keeps. The
engines take turns batch by batch, so leases (a wall-clock TTL) age alike for all.

Within a batch, vLLM's own prefix cache serves every request of a prefix after the
first, with or without a connector; so a store hit is counted as in the ``vllm``
workload, prompt tokens served from cache minus what an engine with no connector
serves on the same batch, and the offline bounds (best static choice, Belady) are
computed on the trace as the store sees it: each batch's requests of one prefix as
one request. All hit rates are over every prompt token of the trace.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpipe.connector.engines.launch import (
    kvpipe_transfer,
    model_dir,
    mooncake_transfer,
    segment_holder,
    store_section,
    vllm_mooncake_config,
    vllm_mooncake_env,
)
from kvpipe.connector.store.mooncake.master import LocalMaster, MasterEndpoints

from .capacity import SCENARIOS, TARGETED
from .capacity_replay import BATCH
from .kvbench import MiB
from .result import BenchOptions, Target, WorkloadResult
from .reuse_trace import Trace, TraceRequest, belady_hits, best_static_hits
from .vllm_engine import EngineProcess
from .vllm_prefix import BLOCK, TINY, VOCAB, reset_prefix_cache

NONE, KVPIPE, KVPIPE_NO_RETENTION, KVPIPE_LENT_RULE, VLLM = (
    "no connector",
    "kvpipe",
    "kvpipe, retention off",
    "kvpipe, pin budget from what it lends (0)",
    "vLLM's connector",
)
CONTENDERS = (KVPIPE, KVPIPE_NO_RETENTION, VLLM)
#: who lends each store its memory: the engine itself, or a client of its own (the engines lend none)
ENGINE, STORE_NODE = "engine", "store node"
#: kvpipe's contenders' settings beside the store, by who lends the memory
KVPIPE_EXTRAS: dict[str, dict[str, dict[str, Any]]] = {
    ENGINE: {KVPIPE: {}, KVPIPE_NO_RETENTION: {"retention": False}},
    # what the default budget was for an engine that lends nothing: 0.9 of 0 bytes
    STORE_NODE: {KVPIPE: {}, KVPIPE_LENT_RULE: {"retention_max_pinned": 0}},
}
STATIC, BELADY = "best static (offline)", "Belady (offline)"
SCENARIO = next(scenario for scenario in SCENARIOS if scenario.name == TARGETED)
#: the store's memory, as a share of the shared prefixes' KV bytes
FRACTION = 0.5
#: the quick trace: a few batches, enough for a prefix to come back from the store
QUICK_REQUESTS = 60
#: batches between two progress lines
PROGRESS_EVERY = 20


def run(options: BenchOptions, *, lent_by: str = ENGINE, fraction: float = FRACTION) -> WorkloadResult:
    """The trace through each contender's engine; ``lent_by``: :data:`ENGINE` or :data:`STORE_NODE`."""
    trace = SCENARIO.trace(QUICK_REQUESTS if options.quick else None)
    per_token = kv_bytes_per_token(TINY.config)
    prefix_bytes = trace.prefix_chunks * BLOCK * per_token
    capacity = int(fraction * trace.prefixes * prefix_bytes)
    contenders = (*KVPIPE_EXTRAS[lent_by], VLLM)
    served = _serve(trace, capacity, lent_by)
    rows = [
        _row(name, served[name], served[NONE], trace.prompt_chunks * BLOCK) for name in (NONE, *contenders)
    ]
    rows += _offline_rows(trace, capacity // prefix_bytes)
    in_batch_repeats = len(trace.requests) - len(store_view(trace).requests)
    lender = "lent by the engine" if lent_by == ENGINE else "lent by a store node, the engines lending none"
    return WorkloadResult(
        workload="capacity-engine" if lent_by == ENGINE else "capacity-engine-store-node",
        description=(
            f"the real vLLM engine (tiny dummy Llama) on the capacity workload's '{SCENARIO.name}' trace, "
            f"{len(trace.requests)} requests in batches of {BATCH}, vLLM's prefix cache reset between batches; "
            f"each store {fraction:g}x of the {trace.prefixes} prefixes' KV ({capacity / MiB:g} MiB), "
            f"{lender}, Mooncake's default leases"
        ),
        columns=[
            "contender",
            "hit rate",
            "hit tokens",
            "cached tokens",
            "connector hits",
            "pinned at end",
            "seconds",
        ],
        rows=rows,
        targets=_targets({row["contender"]: row["hit rate"] for row in rows}),
        notes=[
            "hit rate = prompt tokens served from the store / all prompt tokens; served from the store = "
            "cached tokens minus the no-connector engine's on the same batches (vLLM's own cache within a batch)",
            "connector hits: vLLM's external_prefix_cache_hits counter (vLLM's connector loads one copy per "
            "request, so it counts a prefix once per request of the batch)",
            "best static and Belady: whole prefixes, on the trace with each batch's requests of a prefix as one",
            "seconds: the contender's batches and prefix-cache resets, engines taking turns (no target)",
            "pinned at end: objects the contender's store holds soft-pinned after the trace (its master's count)",
        ],
        parameters={
            "quick": options.quick,
            "lent_by": lent_by,
            "requests": len(trace.requests),
            "prefix_tokens": trace.prefix_chunks * BLOCK,
            "suffix_tokens": trace.suffix_chunks * BLOCK,
            "kv_bytes_per_token": per_token,
            "working_set_mib": trace.prefixes * prefix_bytes / MiB,
            "capacity_mib": capacity / MiB,
            "prefixes_fit": capacity // prefix_bytes,
            # what the no-connector engine's cached tokens should be: vLLM's own cache within batches
            "in_batch_repeat_tokens": in_batch_repeats * trace.prefix_chunks * BLOCK,
        },
    )


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token (bf16, as :func:`~.launch.make_llm` runs models)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    layers = config["num_hidden_layers"]
    # int(): the figures come from a model's config.json, untyped
    return int(2 * layers * config.get("num_key_value_heads", heads) * head_dim * dtype_bytes)


def store_view(trace: Trace) -> Trace:
    """``trace`` as the store sees it: in each batch, only a prefix's first request reaches it.

    The others find the prefix in vLLM's own cache (the first request computed or
    loaded it in the same batch), connector or not.
    """
    kept: list[TraceRequest] = []
    for start in range(0, len(trace.requests), BATCH):
        firsts: dict[str, TraceRequest] = {}
        for request in trace.requests[start : start + BATCH]:
            firsts.setdefault(request.prefix, request)
        kept.extend(firsts.values())
    return replace(trace, requests=tuple(kept))


def prompt_ids(trace: Trace) -> list[list[int]]:
    """Each request's tokens: its prefix's (the same in every request of it), then its own block's."""
    prefixes: dict[str, list[int]] = {}
    made = []
    for request in trace.requests:
        if request.prefix not in prefixes:
            prefixes[request.prefix] = _tokens(request.prefix, trace.prefix_chunks * BLOCK)
        made.append(
            prefixes[request.prefix] + _tokens(f"suffix-{request.index}", trace.suffix_chunks * BLOCK)
        )
    return made


def _tokens(name: str, count: int) -> list[int]:
    """``count`` token ids drawn from a generator seeded by ``name``: the same in every run."""
    rng = random.Random(name)
    return [rng.randrange(VOCAB) for _ in range(count)]


@dataclass
class Served:
    """What one engine's batches got from vLLM's counters, summed, and its time."""

    cached: int = 0  # prompt tokens served from cache, vLLM's own or the connector's
    connector_hits: int = 0
    seconds: float = 0.0
    pinned_keys: int | None = None  # soft-pinned objects in its store at the end (None: no store)


def _serve(trace: Trace, capacity: int, lent_by: str = ENGINE) -> dict[str, Served]:
    """Every engine's run of the trace, batch by batch in turns, each reset after its batch."""
    prompts = prompt_ids(trace)
    with tempfile.TemporaryDirectory(prefix="kvpipe-bench-capacity-engine-") as scratch, ExitStack() as stack:
        specs = {NONE: _spec(None, {}, trace)}
        masters: dict[str, MasterEndpoints] = {}
        # the engine lends the store all of it, or a store node does and the engine nothing
        lent = capacity if lent_by == ENGINE else 0
        for name, extra in KVPIPE_EXTRAS[lent_by].items():
            endpoints = masters[name] = stack.enter_context(_master(capacity if lent_by == STORE_NODE else 0))
            store = store_section(endpoints, lent)
            if lent_by == STORE_NODE:  # where the worker reads the store's capacity
                store["master_metrics"] = [f"{endpoints.host}:{endpoints.metrics_port}"]
            specs[name] = _spec(kvpipe_transfer({"store": store, **extra}), {}, trace)
        config = Path(scratch) / "mooncake.json"
        masters[VLLM] = stack.enter_context(_master(capacity if lent_by == STORE_NODE else 0))
        config.write_text(json.dumps(vllm_mooncake_config(masters[VLLM], lent)))
        specs[VLLM] = _spec(mooncake_transfer(), vllm_mooncake_env(config), trace)
        # each in the stack as soon as it runs: an error or a signal stops every one started
        engines = {name: stack.enter_context(EngineProcess(*spec)) for name, spec in specs.items()}
        for engine in engines.values():
            engine.wait_ready()
        served = {name: Served() for name in engines}
        batches = [prompts[start : start + BATCH] for start in range(0, len(prompts), BATCH)]
        for number, batch in enumerate(batches, start=1):
            for name, engine in engines.items():
                began = time.perf_counter()
                answer = engine.call({"generate": batch, "max_tokens": 1})
                reset_prefix_cache(engine)
                served[name].seconds += time.perf_counter() - began
                served[name].cached += sum(answer["cached"])
                served[name].connector_hits += answer["connector_hits"]
            if number % PROGRESS_EVERY == 0 or number == len(batches):
                _progress(number, len(batches), served)
        for name, endpoints in masters.items():
            served[name].pinned_keys = _soft_pinned_keys(endpoints)
        return served


def _soft_pinned_keys(endpoints: MasterEndpoints) -> int | None:
    """The objects the master holds soft-pinned now (its metrics page); None if it does not say."""
    url = f"http://{endpoints.host}:{endpoints.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as answer:  # noqa: S310 - the master this bench started
        lines = answer.read().decode().splitlines()
    counts = [line.split()[-1] for line in lines if line.startswith("master_soft_pin_key_count ")]
    return int(float(counts[0])) if counts else None


@contextmanager
def _master(held: int = 0) -> Iterator[MasterEndpoints]:
    """A fresh master with Mooncake's defaults: one contender's store, empty.

    ``held``: the bytes a client of its own (a store node) lends it; 0: the engine lends them.
    """
    with LocalMaster() as master, ExitStack() as holder:
        assert master.endpoints is not None
        if held:
            holder.enter_context(segment_holder(master.endpoints, held))
        yield master.endpoints


def _spec(
    transfer: Mapping[str, Any] | None, env: Mapping[str, str], trace: Trace
) -> tuple[dict[str, Any], dict[str, str]]:
    """An in-process engine on the tiny model, long enough for the trace's prompts and one output token."""
    spec = {
        "model": str(model_dir(TINY.name, TINY.config)),
        "transfer": transfer,
        "max_model_len": (trace.prefix_chunks + trace.suffix_chunks) * BLOCK + 1,
        "kv_cache_memory_bytes": TINY.kv_cache_memory_bytes,
    }
    # vLLM logs to stdout by default, and its connector's save thread warns of every put a full
    # store refuses: a line written between an answer and its newline would garble the answer
    quiet_stdout = {"VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    return spec, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **quiet_stdout, **env}


def _progress(number: int, batches: int, served: Mapping[str, Served]) -> None:
    """One line every few batches on stderr, so a long run is visibly alive."""
    reference = served[NONE].cached
    hits = "; ".join(f"{name} {served[name].cached - reference:,}" for name in served if name != NONE)
    print(
        f"-- capacity-engine batch {number}/{batches}: store hit tokens {hits}", file=sys.stderr, flush=True
    )


def _offline_rows(trace: Trace, prefixes_fit: int) -> list[dict[str, Any]]:
    """The best static choice and Belady's optimum over the requests that reach the store."""
    seen = store_view(trace)
    return [
        {"contender": name, "hit rate": round(trace.hit_rate(hits), 3), "hit tokens": hits * BLOCK}
        for name, hits in (
            (STATIC, best_static_hits(seen, prefixes_fit)),
            (BELADY, belady_hits(seen, prefixes_fit)),
        )
    ]


def _targets(hit_rates: Mapping[str, float]) -> list[Target]:
    static = hit_rates[STATIC]
    return [
        Target(
            name="kvpipe - vLLM's connector (hit rate)",
            measured=round(hit_rates[KVPIPE] - hit_rates[VLLM], 3),
            goal=0.0,
        ),
        Target(
            name="kvpipe / best static (hit rate)",
            measured=round(hit_rates[KVPIPE] / static, 3) if static else 0.0,
            goal=0.9,
        ),
    ]


def _row(name: str, served: Served, reference: Served, prompt_tokens: int) -> dict[str, Any]:
    hits = served.cached - reference.cached
    return {
        "contender": name,
        "hit rate": round(hits / prompt_tokens, 3),
        "hit tokens": hits,
        "cached tokens": served.cached,
        "connector hits": served.connector_hits,
        "pinned at end": "" if served.pinned_keys is None else served.pinned_keys,
        "seconds": round(served.seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpipe.connector.bench.capacity_engine``: one layout of the workload, its table printed.

    ``kvpipe bench capacity-engine`` runs the engine-lent layout; this also runs the
    store-node one (``--lent-by store-node``), its record written beside the suite's.
    """
    parser = argparse.ArgumentParser(prog="python -m kvpipe.connector.bench.capacity_engine")
    parser.add_argument("--lent-by", choices=["engine", "store-node"], default="engine")
    parser.add_argument(
        "--fraction", type=float, default=FRACTION, help="the store's share of the prefixes' KV"
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    options = BenchOptions(quick=args.quick)
    started = time.perf_counter()
    result = run(options, lent_by=ENGINE if args.lent_by == "engine" else STORE_NODE, fraction=args.fraction)
    result.parameters["wall_s"] = round(time.perf_counter() - started, 1)
    result.write(options.out_dir)
    print(result.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
