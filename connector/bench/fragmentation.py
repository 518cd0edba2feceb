"""``fragmentation``: how much of what the store keeps is chunks it has cut in pieces.

The shape of Mooncake RFC #2127's table. A chunk is reusable only whole (every
storable group, every TP rank), yet without group ids Mooncake leases and evicts
each object alone. Reads that touch only some of a chunk's objects keep those
alive while the others expire and go: the store then spends memory on chunks no
lookup can ever hit. Group ids (``ReplicateConfig.group_ids``) make a read of any
member refresh the whole chunk and eviction take it whole.

The run: ``kvpipe run``'s job (engine stand-in, save pipeline, chat workload)
unchanged, on a real spawned ``mooncake_master`` whose only client mounts a
segment of a fraction of the workload's bytes, with a hybrid model on two TP ranks (full attention + mamba
in ``align`` mode: four objects per chunk). Beside it a second instance of the
same model keeps loading a few hot prefixes the way a hybrid model's load does:
the attention KV of every chunk of the hit, the mamba state at its end only.
After the run, once the master's background eviction has settled, every chunk
the pipeline considered is counted complete, partial or absent, with the bytes
its surviving objects hold.

With group semantics partial bytes must be zero at every capacity (the target);
without them the figure is reported, not targeted: it is what the option buys.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from kvpipe.connector.run import workload
from kvpipe.connector.run.check import EXIST_BATCH, ChunkCounts
from kvpipe.connector.run.config import RunConfig
from kvpipe.connector.run.job import build_cache
from kvpipe.connector.run.job import run as run_job
from kvpipe.connector.run.synthetic import SyntheticCache
from kvpipe.connector.store.configs import MooncakeStoreConfig
from kvpipe.connector.store.mooncake import MIN_SEGMENT_BYTES, MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster, MasterEndpoints
from kvpipe.stages import (
    EXISTS,
    GroupKind,
    LoadRequest,
    StoreObject,
    load_targets,
    prefix_unit,
    storable_groups,
)

from .plot import line_plot
from .result import BenchOptions, Target, WorkloadResult

MiB = 1 << 20

#: Store capacity as a fraction of the workload's bytes: three that evict, one with room.
FRACTIONS = (0.25, 0.5, 0.75, 1.25)
QUICK_FRACTIONS = (0.5,)
REQUESTS = 150
QUICK_REQUESTS = 60
#: Prompts of the workload's first requests: the prefixes the second instance keeps loading.
HOT_PREFIXES = 8
#: Short leases, so an object not read for a moment can be evicted (the master's default is seconds).
LEASE_TTL_MS = 100
HIGH_WATERMARK = 0.9
EVICTION_RATIO = 0.05
#: The pause between two loads of the hot prefixes.
READ_PAUSE_S = 0.01
#: The store has settled when its key count and allocated bytes hold this long.
SETTLE_QUIET_S = 3 * LEASE_TTL_MS / 1000
SETTLE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Tally:
    """What the store holds of the run's chunks once eviction has settled."""

    chunks: ChunkCounts
    live_bytes: int  # bytes of every object still stored
    partial_bytes: int  # of those, the bytes of chunks that lost some objects

    @property
    def partial_ratio(self) -> float:
        return self.partial_bytes / self.live_bytes if self.live_bytes else 0.0


@dataclass(frozen=True)
class Point:
    """One run: a capacity, group semantics on or off, and what the store kept."""

    capacity: int
    semantics: bool
    tally: Tally


class _Eviction(TypedDict):
    """The master's eviction keywords, passed to :class:`LocalMaster` and recorded as parameters."""

    eviction_high_watermark: float
    eviction_ratio: float


def run(options: BenchOptions) -> WorkloadResult:
    requests_count = QUICK_REQUESTS if options.quick else REQUESTS
    fractions = QUICK_FRACTIONS if options.quick else FRACTIONS
    config = _config(requests_count)
    requests = _requests(config)
    hot = [request.prompt for request in requests[:HOT_PREFIXES]]
    block_size = config.model.block_size
    # The second instance's cache: just large enough for the longest hot prefix.
    landing = build_cache(
        config.model_copy(
            update={"model": config.model.model_copy(update={"num_blocks": 1 + _longest(hot, block_size)})}
        )
    )
    # hash blocks are blocks here (no hash_block_size), so every block hash names a chunk
    chunks = {h for request in requests for h in workload.chain_hashes(request.tokens, block_size)}
    workload_bytes = len(chunks) * _chunk_bytes(landing)

    points: list[Point] = []
    unsettled = 0
    eviction: _Eviction = {"eviction_high_watermark": HIGH_WATERMARK, "eviction_ratio": EVICTION_RATIO}
    with LocalMaster(lease_ttl_ms=LEASE_TTL_MS, **eviction) as master:
        assert master.endpoints is not None
        for fraction in fractions:
            capacity = max(MIN_SEGMENT_BYTES, round(fraction * workload_bytes / MiB) * MiB)
            for semantics in (False, True):
                run_config = _config(requests_count, master.endpoints, capacity, semantics)
                tally, settled = _measure(run_config, master.endpoints, landing, hot)
                unsettled += not settled
                points.append(Point(capacity, semantics, tally))

    notes = [
        "a chunk = 2 TP ranks x (full attention + mamba align) = 4 objects; hot loads read every "
        "chunk's attention objects and the mamba state of the last chunk only",
        "counted over every chunk the pipeline considered, after the master's eviction settled",
        "group semantics off is reported, not targeted",
    ]
    if unsettled:
        notes.append(f"{unsettled} run(s) still changing after {SETTLE_TIMEOUT_S:g} s: counted anyway")
    grouped = [point.tally.partial_ratio for point in points if point.semantics]
    return WorkloadResult(
        workload="fragmentation",
        description="partial-chunk bytes / live bytes vs store capacity, group semantics on and off",
        columns=list(_row(points[0], workload_bytes)),
        rows=[_row(point, workload_bytes) for point in points],
        targets=[Target(name="partial/live with group ids (max)", measured=max(grouped), goal=0.0, op="<=")],
        notes=notes,
        plots=[str(_plot(points, workload_bytes, options.out_dir))],
        parameters={
            "requests": requests_count,
            "workload_mib": round(workload_bytes / MiB, 1),
            "chunks": len(chunks),
            "hot_prefixes": len(hot),
            "lease_ttl_ms": LEASE_TTL_MS,
            **eviction,
        },
    )


def _config(
    requests: int,
    master: MasterEndpoints | None = None,
    capacity: int = MIN_SEGMENT_BYTES,
    enable_group_semantics: bool = False,
) -> RunConfig:
    """The run: a hybrid model on two TP ranks, a chat workload, a client of ``capacity`` bytes.

    The client's segment is the whole store: it is the only one mounted on ``master``.
    """
    store: dict[str, Any] = {
        "kind": "mooncake",
        "global_segment_size": capacity,
        "local_buffer_size": 16 * MiB,
    }
    if master is not None:
        store |= {"master": master.master_address, "metadata_server": master.metadata_server}
    return RunConfig.model_validate(
        {
            "store": store,
            "model": {
                "name": "synthetic-hybrid",
                "block_size": 16,
                "num_blocks": 1024,
                "groups": [{"kind": "full_attention"}, {"kind": "mamba", "mamba_mode": "align", "layers": 2}],
            },
            "parallel": {"tp_size": 2},
            "workload": {"seed": 1, "requests": requests, "concurrency": 16},
            "save": {"enable_group_semantics": enable_group_semantics},
        }
    )


def _requests(config: RunConfig) -> list[workload.Request]:
    """The job's own workload (same config, same seed, so the same requests)."""
    pacing = {"concurrency", "prefill_tokens_per_step", "decode_tokens_per_step"}
    return workload.generate(**config.workload.model_dump(exclude=pacing))


def _longest(prompts: Sequence[tuple[int, ...]], block_size: int) -> int:
    return max(len(prompt) // block_size for prompt in prompts)


def _chunk_bytes(cache: SyntheticCache) -> int:
    """A chunk's bytes: one object per storable group per rank."""
    groups = storable_groups(cache.kv)
    return sum(shard.layouts[g.engine_group].object_size for shard in cache.kv.shards for g in groups)


def _measure(
    config: RunConfig, master: MasterEndpoints, landing: SyntheticCache, hot: Sequence[tuple[int, ...]]
) -> tuple[Tally, bool]:
    """Run the job on a fresh client with hot loads beside it; count once the master has settled.

    A fresh client per run: closing one takes its segment's objects with it, so
    every run starts on an empty store, and no registration of a finished run's
    (freed) cache is left to overlap the next run's.
    """
    assert isinstance(config.store, MooncakeStoreConfig)
    with MooncakeStore.open(config.store) as store:
        for address, nbytes in landing.memory_regions():
            store.register_buffer(address, nbytes)
        with _HotLoads(store, _hot_targets(landing, hot)):
            result = run_job(config, store=store)
        settled = _settle(master)
        return _tally(store, [record for record, _ in result.objects.values()]), settled


def _hot_targets(landing: SyntheticCache, prompts: Sequence[tuple[int, ...]]) -> list[StoreObject]:
    """The objects a hybrid model's load of each prompt's stored prefix reads, each once.

    Attention groups need the KV of every chunk of the hit; a mamba group (align
    mode) only the state at the hit's end, which is all its block table holds.
    """
    kv = landing.kv
    groups = storable_groups(kv)
    unit = prefix_unit(groups)
    records: dict[str, StoreObject] = {}
    for index, prompt in enumerate(prompts):
        hashes = tuple(workload.chain_hashes(prompt, kv.hash_block_size))
        end = len(hashes) * kv.hash_block_size // unit * unit
        if not end:
            continue
        block_ids = tuple(tuple(range(1, 1 + end // spec.block_size)) for spec in kv.groups)
        for group in groups:
            start = end - group.spec.block_size if group.spec.kind is GroupKind.MAMBA else 0
            load = LoadRequest(f"hot-{index}", hashes, block_ids, start, end)
            for target in load_targets([group], kv.shards, kv.hash_block_size, load):
                records.setdefault(target.record.key, target.record)
    return list(records.values())


class _HotLoads:
    """A thread that keeps reading ``records`` (as another instance's loads would) until exit."""

    def __init__(self, store: MooncakeStore, records: Sequence[StoreObject]) -> None:
        self._store = store
        self._keys = [record.key for record in records]
        self._ptrs = [[buffer.address for buffer in record.buffers] for record in records]
        self._sizes = [[buffer.size for buffer in record.buffers] for record in records]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hot-loads", daemon=True)

    def __enter__(self) -> _HotLoads:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(READ_PAUSE_S):
            self._store.batch_get_into_multi_buffers(self._keys, self._ptrs, self._sizes)


def _settle(endpoints: MasterEndpoints) -> bool:
    """Wait until eviction (a background thread in the master) stops changing the store.

    Polls the master's gauges, not the keys: asking for a key would refresh its
    lease and so change what gets evicted. False if still changing at the timeout.
    """
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last, since = _gauges(endpoints), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _gauges(endpoints)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= SETTLE_QUIET_S:
            return True
    return False


def _gauges(endpoints: MasterEndpoints) -> tuple[str, ...]:
    """The master's key count and allocated bytes, as its metrics page shows them."""
    url = f"http://{endpoints.host}:{endpoints.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as answer:
        lines = answer.read().decode().splitlines()
    return tuple(line for line in lines if line.startswith(("master_key_count ", "master_allocated_bytes ")))


def _tally(store: MooncakeStore, records: Sequence[StoreObject]) -> Tally:
    """Per chunk (one chunk hash), which of its objects exist, and the bytes they hold."""
    present: dict[str, bool] = {}
    for start in range(0, len(records), EXIST_BATCH):
        keys = [record.key for record in records[start : start + EXIST_BATCH]]
        present.update(zip(keys, (answer == EXISTS for answer in store.batch_is_exist(keys)), strict=True))
    by_chunk: dict[bytes, list[StoreObject]] = {}
    for record in records:
        by_chunk.setdefault(record.chunk_hash, []).append(record)
    complete = partial = absent = live_bytes = partial_bytes = 0
    for members in by_chunk.values():
        kept = [record for record in members if present[record.key]]
        kept_bytes = sum(record.size for record in kept)
        live_bytes += kept_bytes
        if len(kept) == len(members):
            complete += 1
        elif kept:
            partial += 1
            partial_bytes += kept_bytes
        else:
            absent += 1
    return Tally(ChunkCounts(len(by_chunk), complete, partial, absent), live_bytes, partial_bytes)


def _row(point: Point, workload_bytes: int) -> dict[str, Any]:
    tally = point.tally
    return {
        "capacity MiB": point.capacity // MiB,
        "capacity/workload": round(point.capacity / workload_bytes, 3),
        "group semantics": "on" if point.semantics else "off",
        "live MiB": round(tally.live_bytes / MiB, 2),
        "partial MiB": round(tally.partial_bytes / MiB, 2),
        "partial/live": round(tally.partial_ratio, 4),
        "complete": tally.chunks.complete,
        "partial": tally.chunks.partial,
        "absent": tally.chunks.absent,
    }


def _plot(points: Sequence[Point], workload_bytes: int, out_dir: Path) -> Path:
    """partial/live over capacity/workload, one line per semantics setting."""
    off = [point for point in points if not point.semantics]
    on = [point for point in points if point.semantics]
    return line_plot(
        out_dir / "fragmentation.png",
        "Partial-chunk bytes vs store capacity (real Mooncake)",
        "store capacity / workload bytes",
        "partial-chunk bytes / live bytes",
        [point.capacity / workload_bytes for point in off],
        {
            "group semantics off": [point.tally.partial_ratio for point in off],
            "group semantics on": [point.tally.partial_ratio for point in on],
        },
    )
