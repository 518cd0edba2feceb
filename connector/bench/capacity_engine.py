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

import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpipe.connector.engines.launch import (
    kvpipe_transfer,
    model_dir,
    mooncake_transfer,
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

NONE, KVPIPE, KVPIPE_NO_RETENTION, VLLM = (
    "no connector",
    "kvpipe",
    "kvpipe, retention off",
    "vLLM's connector",
)
CONTENDERS = (KVPIPE, KVPIPE_NO_RETENTION, VLLM)
STATIC, BELADY = "best static (offline)", "Belady (offline)"
SCENARIO = next(scenario for scenario in SCENARIOS if scenario.name == TARGETED)
#: the store's memory, as a share of the shared prefixes' KV bytes
FRACTION = 0.5
#: the quick trace: a few batches, enough for a prefix to come back from the store
QUICK_REQUESTS = 60
#: batches between two progress lines
PROGRESS_EVERY = 20


def run(options: BenchOptions) -> WorkloadResult:
    trace = SCENARIO.trace(QUICK_REQUESTS if options.quick else None)
    per_token = kv_bytes_per_token(TINY.config)
    prefix_bytes = trace.prefix_chunks * BLOCK * per_token
    capacity = int(FRACTION * trace.prefixes * prefix_bytes)
    served = _serve(trace, capacity)
    rows = [
        _row(name, served[name], served[NONE], trace.prompt_chunks * BLOCK) for name in (NONE, *CONTENDERS)
    ]
    rows += _offline_rows(trace, capacity // prefix_bytes)
    in_batch_repeats = len(trace.requests) - len(store_view(trace).requests)
    return WorkloadResult(
        workload="capacity-engine",
        description=(
            f"the real vLLM engine (tiny dummy Llama) on the capacity workload's '{SCENARIO.name}' trace, "
            f"{len(trace.requests)} requests in batches of {BATCH}, vLLM's prefix cache reset between batches; "
            f"each store {FRACTION:g}x of the {trace.prefixes} prefixes' KV ({capacity / MiB:g} MiB), "
            "lent by the engine, Mooncake's default leases"
        ),
        columns=["contender", "hit rate", "hit tokens", "cached tokens", "connector hits", "seconds"],
        rows=rows,
        targets=_targets({row["contender"]: row["hit rate"] for row in rows}),
        notes=[
            "hit rate = prompt tokens served from the store / all prompt tokens; served from the store = "
            "cached tokens minus the no-connector engine's on the same batches (vLLM's own cache within a batch)",
            "connector hits: vLLM's external_prefix_cache_hits counter (vLLM's connector loads one copy per "
            "request, so it counts a prefix once per request of the batch)",
            "best static and Belady: whole prefixes, on the trace with each batch's requests of a prefix as one",
            "seconds: the contender's batches and prefix-cache resets, engines taking turns (no target)",
        ],
        parameters={
            "quick": options.quick,
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


def _serve(trace: Trace, capacity: int) -> dict[str, Served]:
    """Every engine's run of the trace, batch by batch in turns, each reset after its batch."""
    prompts = prompt_ids(trace)
    with tempfile.TemporaryDirectory(prefix="kvpipe-bench-capacity-engine-") as scratch, ExitStack() as stack:
        specs = {NONE: _spec(None, {}, trace)}
        for name, extra in ((KVPIPE, {}), (KVPIPE_NO_RETENTION, {"retention": False})):
            endpoints = stack.enter_context(_master())
            specs[name] = _spec(
                kvpipe_transfer({"store": store_section(endpoints, capacity), **extra}), {}, trace
            )
        config = Path(scratch) / "mooncake.json"
        config.write_text(json.dumps(vllm_mooncake_config(stack.enter_context(_master()), capacity)))
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
        return served


@contextmanager
def _master() -> Iterator[MasterEndpoints]:
    """A fresh master with Mooncake's defaults: one contender's store, empty."""
    with LocalMaster() as master:
        assert master.endpoints is not None
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
    hits = "; ".join(f"{name} {served[name].cached - reference:,}" for name in CONTENDERS)
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
        "seconds": round(served.seconds, 1),
    }
