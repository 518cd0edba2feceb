"""``capacity``: what a store smaller than its working set keeps, and the hit rate that buys.

A skewed trace (:mod:`.reuse_trace`: 40 shared prefixes of 8 chunks drawn from
Zipf(s), each request with a chunk of its own; and a mix where half the
requests are one-off documents nobody asks for again) is replayed against a
real spawned ``mooncake_master`` whose only segment holds 0.25x, 0.5x or 0.75x
of the shared prefixes' bytes. Each contender makes its connector's own store
calls (:mod:`.capacity_replay`), on a fresh client (an empty store) per point.
Beside them, from the same trace: the best static choice (the most popular
prefixes that fit, kept forever) and Belady's offline optimum over whole
prefixes. Leases are short (the master's TTL is ten batch periods) so that, as
in a serving fleet, what was read in the last few batches is shielded.

Reported per point: hit rate (hit chunks over prompt chunks), puts refused
(for space, once the put stage's space wait passed), objects the store evicted.

At the smallest capacity kvpipe runs once more with Mooncake's SSD tier behind
the memory segment, on a master that offloads what it evicts: a disk that holds
the working set (every chunk the trace writes, one-off ones included: the disk
keeps the least recently read, so it must outlast the one-off chunks put between
two reuses of a prefix), beside the hit rate of an unbounded store (every prefix
kept once first computed).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster, MasterEndpoints
from kvpipe.connector.store.mooncake.settings import DiskTier
from kvpipe.stages.retention import PINNED_SHARE

from .capacity_replay import BATCH, KvpipeReplay, Replay, Tally, VllmReplay, evictions, prompts, replay
from .kvbench import BenchCache, MiB
from .result import BenchOptions, Target, WorkloadResult
from .reuse_trace import Trace, belady_hits, best_static_hits, zipf_trace

PREFIXES = 40
PREFIX_CHUNKS = 8
SUFFIX_CHUNKS = 1
LAYERS = 4
#: 4 layers x 64 KiB = 256 KiB a chunk: 40 prefixes = 80 MiB, so 0.25x is above the client's 16 MiB floor
BUFFER_BYTES = 64 * 1024
FRACTIONS = (0.25, 0.5, 0.75)
#: one batch of requests a period; leases last LEASE_PERIODS of them
PERIOD_S = 0.03
LEASE_PERIODS = 10
#: the SSD tier's run: memory at this capacity, a disk of the trace's bytes
DISK_MEMORY = 0.25
QUICK_FRACTIONS = (DISK_MEMORY,)


@dataclass(frozen=True)
class Scenario:
    name: str
    s: float
    one_off_share: float
    requests: int

    def trace(self, requests: int | None = None) -> Trace:
        return zipf_trace(
            requests=requests or self.requests,
            prefixes=PREFIXES,
            s=self.s,
            prefix_chunks=PREFIX_CHUNKS,
            suffix_chunks=SUFFIX_CHUNKS,
            one_off_share=self.one_off_share,
            seed=1,
        )


#: Long enough to reach a steady state: every policy pays the first request of each prefix,
#: and an online one (which cannot tell a shared prefix from a one-off document the first
#: time) pays a second before it keeps it; on 400 requests that warm-up is most of the trace.
SCENARIOS = (
    Scenario("zipf 0.8", 0.8, 0.0, 800),
    Scenario("zipf 1.0", 1.0, 0.0, 800),
    Scenario("zipf 1.2", 1.2, 0.0, 800),
    Scenario("zipf 1.0, half one-off", 1.0, 0.5, 1600),
)
#: the scenario the targets are set on
TARGETED = "zipf 1.0, half one-off"


@contextmanager
def _no_context(replay_: Replay) -> Iterator[Replay]:
    yield replay_


#: a contender over a bench cache and a store whose capacity (bytes) is given
Contender = Callable[[BenchCache, MooncakeStore, int], AbstractContextManager[Replay]]
CONTENDERS: dict[str, Contender] = {
    "kvpipe": lambda cache, store, capacity: KvpipeReplay(
        cache, store, max_pinned_bytes=int(PINNED_SHARE * capacity)
    ),
    "kvpipe, retention off": lambda cache, store, capacity: KvpipeReplay(cache, store),
    "vLLM's connector": lambda cache, store, capacity: _no_context(VllmReplay(cache, store)),
}


def run(options: BenchOptions) -> WorkloadResult:
    scenarios = SCENARIOS[-1:] if options.quick else SCENARIOS
    fractions = QUICK_FRACTIONS if options.quick else FRACTIONS
    cache = BenchCache.build(
        layers=LAYERS, buffer_bytes=BUFFER_BYTES, num_blocks=PREFIX_CHUNKS + SUFFIX_CHUNKS + 2
    )
    working_set = PREFIXES * PREFIX_CHUNKS * cache.object_bytes
    rows: list[dict[str, Any]] = []
    targets: list[Target] = []
    lease_ms = round(LEASE_PERIODS * PERIOD_S * 1000)
    with (
        LocalMaster(lease_ttl_ms=lease_ms) as master,
        LocalMaster(lease_ttl_ms=lease_ms, enable_offload=True) as offloading,
    ):
        assert master.endpoints is not None and offloading.endpoints is not None
        for scenario in scenarios:
            trace = scenario.trace(120 if options.quick else None)
            for fraction in fractions:
                capacity = round(fraction * working_set / MiB) * MiB
                prefixes_fit = capacity // (PREFIX_CHUNKS * cache.object_bytes)
                static = trace.hit_rate(best_static_hits(trace, prefixes_fit))
                row: dict[str, Any] = {
                    "scenario": scenario.name,
                    "capacity": fraction,
                    "best static": round(static, 3),
                    "Belady": round(trace.hit_rate(belady_hits(trace, prefixes_fit)), 3),
                }
                for name, make in CONTENDERS.items():
                    with _client(master.endpoints, capacity) as store, cache.registered(store):
                        with make(cache, store, capacity) as ours:
                            tally = replay(ours, trace, cache, PERIOD_S)
                        evicted = evictions(tally, trace, cache, store)
                    row[name] = round(trace.hit_rate(tally.hit_chunks), 3)
                    row[f"{name} refused"] = tally.puts_refused
                    row[f"{name} evicted"] = evicted
                if fraction == DISK_MEMORY:
                    unbounded = trace.hit_rate(belady_hits(trace, PREFIXES))
                    row["unbounded"] = round(unbounded, 3)
                    tally = _with_disk(offloading.endpoints, cache, trace, capacity)
                    row["kvpipe + disk"] = round(trace.hit_rate(tally.hit_chunks), 3)
                    row["kvpipe + disk refused"] = tally.puts_refused
                    targets.append(
                        Target(
                            name=f"kvpipe + disk / unbounded ({scenario.name})",
                            measured=round(row["kvpipe + disk"] / unbounded, 3),
                            goal=0.95,
                        )
                    )
                rows.append(row)
                if scenario.name == TARGETED:
                    targets.append(
                        Target(
                            name=f"kvpipe / best static at {fraction}x",
                            measured=round(row["kvpipe"] / static, 3) if static else 0.0,
                            goal=0.9,
                        )
                    )
        for row in rows:
            targets.append(
                Target(
                    name=f"kvpipe - vLLM's connector ({row['scenario']}, {row['capacity']}x)",
                    measured=round(row["kvpipe"] - row["vLLM's connector"], 3),
                    goal=0.0,
                )
            )
    columns = list(rows[0])
    return WorkloadResult(
        workload="capacity",
        description=(
            f"hit rate vs store capacity (a fraction of {PREFIXES} shared prefixes' bytes), real Mooncake; "
            f"{PREFIX_CHUNKS}-chunk prefixes, {SUFFIX_CHUNKS} own chunk a request, {BATCH} requests a "
            f"{PERIOD_S * 1000:g} ms period, leases {lease_ms} ms"
        ),
        columns=columns,
        rows=rows,
        targets=targets,
        notes=[
            "hit rate = chunks loaded from the store / prompt chunks; a prefix's first request always misses",
            "best static and Belady are computed from the trace over whole prefixes",
        ],
        parameters={"working_set_mib": working_set // MiB, "lease_ttl_ms": lease_ms, "period_s": PERIOD_S},
    )


def _with_disk(endpoints: MasterEndpoints, cache: BenchCache, trace: Trace, capacity: int) -> Tally:
    """kvpipe's replay of ``trace`` on a memory segment of ``capacity`` with a disk of the trace's bytes."""
    chunks = {chunk_hash for prompt in prompts(trace, cache) for chunk_hash in prompt.block_hashes}
    with tempfile.TemporaryDirectory(prefix="kvpipe-capacity-disk-") as folder:
        disk = DiskTier(path=Path(folder), size=len(chunks) * cache.object_bytes)
        with _client(endpoints, capacity, disk) as store, cache.registered(store):
            with CONTENDERS["kvpipe"](cache, store, capacity) as ours:
                return replay(ours, trace, cache, PERIOD_S)


@contextmanager
def _client(
    endpoints: MasterEndpoints, capacity: int, disk: DiskTier | None = None
) -> Iterator[MooncakeStore]:
    """A fresh client whose segment (and ``disk``) is the whole store (closing it empties the store)."""
    settings = MooncakeSettings(
        master=endpoints.master_address,
        metadata_server=endpoints.metadata_server,
        global_segment_size=capacity,
        local_buffer_size=16 * MiB,
        disk=disk,
    )
    with MooncakeStore.open(settings) as store:
        yield store
