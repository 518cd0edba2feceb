"""serve-pd: prefill and decode on different engines, the KV cache passing through the store.

``kvpipe bench serve-pd`` (or ``serve --pd``): vLLM's serving benchmark (the ``serve``
workload's ``prefix`` and ``chat`` loads, :mod:`.serve`) through vLLM's router, one
arrangement of two engines after another, each a fleet of its own on one Mooncake
store, each engine on cores of its own:

``kvpipe PD``
    one prefill engine (``kv_both``) and one decode engine (``kv_consumer``) with
    kvpipe's connector, the router in prefill/decode mode: the prefill engine's
    save is a handoff, and the decode engine waits for it (docs/disaggregation.md);
``vLLM PD``
    the same split with vLLM's ``MooncakeStoreConnector``, which returns no
    transfer parameters: its decode engine finds what has landed when it looks;
``kvpipe fleet``
    the same two engines as whole-request replicas, round robin;
``none``
    two replicas without a connector: the outputs every other arrangement must equal.

Per run: the prompt tokens in whole blocks (what a decode engine could load at
most: a request computes its last token), the decode engine's tokens loaded from
the store and found in its own prefix cache, the handoffs that ran out of time,
TTFT and ITL (p50, p99), failed requests, and whether the outputs equal ``none``'s.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpipe.connector.engines import launch
from kvpipe.connector.fleet.fleet import Contender, Fleet, FleetSpec

from .result import BenchOptions, Target, WorkloadResult
from .serve import CONNECTOR_HITS, FULL_LOADS, LOCAL_HITS, QUICK_LOADS, drive, replica_counters, warm
from .vllm_prefix import BIGGER

#: the decode engines' handoffs that ran out of time (a labelled series: read by its label)
EXPIRED = 'kvpipe:handoffs_total{outcome="expired"}'
BLOCK_TOKENS = 128  # the fleets' block size (FleetSpec's default)


@dataclass(frozen=True)
class Arrangement:
    """Two engines: a split (one prefill, one decode) or two whole-request replicas."""

    name: str
    connector: Contender
    split: bool


KVPIPE_PD = Arrangement("kvpipe PD", Contender.KVPIPE, split=True)
VLLM_PD = Arrangement("vLLM PD", Contender.VLLM, split=True)
KVPIPE_FLEET = Arrangement("kvpipe fleet", Contender.KVPIPE, split=False)
NONE = Arrangement("none", Contender.NONE, split=False)
ARRANGEMENTS = (NONE, KVPIPE_PD, VLLM_PD, KVPIPE_FLEET)
QUICK_ARRANGEMENTS = (NONE, KVPIPE_PD)


@dataclass(frozen=True)
class Run:
    """One benchmark client run through one arrangement: its result and the decode engine's counters."""

    arrangement: Arrangement
    load: str
    client: dict[str, Any]
    decode: dict[
        str, float
    ]  # the decode engine's counters' growth (:func:`_decode_counters`; empty without a split)

    @property
    def whole_block_tokens(self) -> int:
        """The prompts' tokens in whole blocks a decode engine may take (it computes at least the last token)."""
        return sum(
            (tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS for tokens in self.client.get("input_lens") or ()
        )

    @property
    def found_share(self) -> float | None:
        """Of those, the share the decode engine did not compute: loaded, or in its own prefix cache."""
        if not self.arrangement.split:
            return None
        found = self.decode[CONNECTOR_HITS] + self.decode[LOCAL_HITS]
        return found / max(1, self.whole_block_tokens)

    def row(self, reference: Run | None) -> dict[str, Any]:
        c, split = self.client, self.arrangement.split
        outputs = list(c.get("generated_texts") or [])
        return {
            "arrangement": self.arrangement.name,
            "workload": self.load,
            "TTFT p50 ms": round(c["median_ttft_ms"], 1),
            "TTFT p99 ms": round(c["p99_ttft_ms"], 1),
            "ITL p50 ms": round(c["median_itl_ms"], 2),
            "ITL p99 ms": round(c["p99_itl_ms"], 2),
            "failed": c["failed"],
            "whole-block prompt tokens": self.whole_block_tokens,
            "decode: loaded tokens": int(self.decode[CONNECTOR_HITS]) if split else "-",
            "decode: local hit tokens": int(self.decode[LOCAL_HITS]) if split else "-",
            "decode: found share": round(self.found_share, 4) if self.found_share is not None else "-",
            "handoffs expired": int(self.decode.get(EXPIRED, 0)) if split else "-",
            "outputs = none's": "-"
            if reference is None or reference is self
            else outputs == list(reference.client.get("generated_texts") or []),
        }


def _decode_counters(urls: Sequence[str]) -> dict[str, float]:
    """The decode engines' tokens from the store and from their own prefix caches now, and their expired handoffs."""
    return replica_counters(urls, (CONNECTOR_HITS, LOCAL_HITS, EXPIRED))


def run(options: BenchOptions) -> WorkloadResult:
    loads = QUICK_LOADS if options.quick else FULL_LOADS
    arrangements = QUICK_ARRANGEMENTS if options.quick else ARRANGEMENTS
    model = (
        launch.model_dir("tiny-llama", launch.TINY_LLAMA)
        if options.quick
        else launch.model_dir(BIGGER.name, BIGGER.config)
    )
    work = Path(tempfile.mkdtemp(prefix="kvpipe-bench-serve-pd-"))
    runs: list[Run] = []
    for arrangement in arrangements:
        spec = FleetSpec(
            replicas=2,
            prefill=int(arrangement.split),
            decode=int(arrangement.split),
            connector=arrangement.connector,
            model=model,
            kv_cache_memory_bytes=(64 << 20) if options.quick else BIGGER.kv_cache_memory_bytes,
            node_segment="256MB" if options.quick else BIGGER.segment_size,
            log_dir=work / arrangement.name.replace(" ", "-"),
        )
        with Fleet(spec) as fleet:
            warm(fleet)
            decoders = [r.url for r in fleet.decoders]
            for w, (name, load) in enumerate(loads.items()):
                before = _decode_counters(decoders) if decoders else {}
                client, _ = drive(fleet, load, seed=w, folder=fleet.log_dir)
                after = _decode_counters(decoders) if decoders else {}
                runs.append(Run(arrangement, name, client, {k: after[k] - before[k] for k in after}))
                print(
                    f"  serve-pd: {arrangement.name} {name}: TTFT p50 {client['median_ttft_ms']:.1f} ms",
                    file=sys.stderr,
                )
    return _result(runs, loads, options, work)


def _result(runs: list[Run], loads: dict[str, Any], options: BenchOptions, work: Path) -> WorkloadResult:
    def find(arrangement: Arrangement, load: str) -> Run | None:
        return next((r for r in runs if (r.arrangement, r.load) == (arrangement, load)), None)

    rows = [r.row(find(NONE, r.load)) for r in runs]
    targets: list[Target] = []
    for load in loads:
        kvpipe, fleet = find(KVPIPE_PD, load), find(KVPIPE_FLEET, load)
        if kvpipe is not None and kvpipe.found_share is not None:
            targets.append(
                Target(
                    name=f"{load}: kvpipe PD, decode found / whole-block prompt tokens",
                    measured=round(kvpipe.found_share, 4),
                    goal=0.99,
                )
            )
        if kvpipe is not None and fleet is not None:
            ratio = kvpipe.client["p99_itl_ms"] / max(1e-9, fleet.client["p99_itl_ms"])
            targets.append(
                Target(
                    name=f"{load}: ITL p99, kvpipe PD / kvpipe fleet",
                    measured=round(ratio, 3),
                    goal=1.0,
                    op="<=",
                )
            )
    targets.append(
        Target(name="failed requests", measured=sum(r.client["failed"] for r in runs), goal=0, op="<=")
    )
    unequal = sum(1 for row in rows if row["outputs = none's"] is False)
    targets.append(Target(name="runs whose outputs differ from none's", measured=unequal, goal=0, op="<="))
    described = "; ".join(f"{name}: {load}" for name, load in loads.items())
    return WorkloadResult(
        workload="serve-pd",
        description=(
            "prefill and decode on different engines through one Mooncake store, vLLM's router in "
            "prefill/decode mode, vLLM's serving benchmark; beside the same engines as a plain fleet"
        ),
        columns=list(rows[0]),
        rows=rows,
        targets=[] if options.quick else targets,
        notes=[
            f"workloads: {described}",
            "vLLM PD's decode found share is shown beside kvpipe's: vLLM's connector has no handoff",
            f"client results and fleet logs in {work}",
        ],
        parameters={"quick": options.quick, "median_of": 1},
    )
