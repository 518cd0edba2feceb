"""``kvpipe run``: save a synthetic workload through the pipeline, read it back, report.

The steps: build the synthetic KV cache and workload from the config, open the
store and register the cache's memory with it, run the engine stand-in with the
save pipeline on the sync bridge (as a connector would), drain, then check the
store (chunks whole? bytes intact?) and assemble the report whose field names
are a contract (see docs/configuration.md, "The report").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpipe.connector.store.configs import MemoryStoreConfig, open_store
from kvpipe.connector.store.protocol import Store
from kvpipe.pipeline import Graph, SyncPipeline, build_graph
from kvpipe.stages import (
    KV_STAGES,
    GroupSpec,
    KVCache,
    ObjectStatus,
    StoreGroup,
    StoreObject,
    default_save_graph,
    storable_groups,
)
from kvpipe.stages.gather import largest_object

from . import baselines as baseline_runs
from . import workload
from .check import count_chunks, final_statuses, verify
from .config import RunConfig
from .engine import Engine, EngineTotals, Pacing
from .synthetic import SyntheticCache, SyntheticGroup


@dataclass
class RunResult:
    report: dict[str, Any]
    objects: dict[str, tuple[StoreObject, ObjectStatus]]  # final status per key


def build_cache(config: RunConfig) -> SyntheticCache:
    model = config.model
    groups = [
        SyntheticGroup(
            GroupSpec(g.kind, model.block_size, g.is_prefix_cacheable, g.mamba_mode),
            g.layers or model.layers,
        )
        for g in config.model.groups
    ]
    return SyntheticCache(
        model=model.name,
        cache_prefix=config.save.cache_prefix,
        groups=groups,
        tp_size=config.parallel.tp_size,
        kv_heads=model.kv_heads,
        head_size=model.head_size,
        dtype=model.dtype,
        num_blocks=model.num_blocks,
        hash_block_size=model.effective_hash_block_size,
    )


def run(
    config: RunConfig,
    *,
    store: Store | None = None,
    on_progress: Callable[[EngineTotals, int], None] | None = None,
    baselines: bool = False,
    on_open: Callable[[Store], None] | None = None,
) -> RunResult:
    """Run the job; on ``store`` if given (kept open), else on the configured one.

    ``on_open``: called with the configured store once it is open (a spawned master
    runs from then until the run ends: a caller says where).

    ``baselines``: after the run, time the pipeline alone and raw puts on the run's
    objects (:mod:`.baselines`; the store needs room for two more copies of what
    the run stored). Without it their report fields are None.

    :raises ValueError: the model cannot hold the workload (``model.num_blocks`` too
        small for the longest request), the memory store cannot hold one object, or
        the store groups cannot be projected.
    Raises what :func:`~kvpipe.connector.store.configs.connect` raises when it opens the store.
    """
    if store is not None:
        return _run_on(config, store, on_progress, baselines)
    with open_store(config.store) as opened:
        if on_open is not None:
            on_open(opened)
        return _run_on(config, opened, on_progress, baselines)


def _check_an_object_fits(config: RunConfig, cache: SyntheticCache) -> None:
    """Refuse a memory store smaller than one object: every put would be refused, after waiting for room."""
    largest = largest_object(cache.kv)
    if isinstance(config.store, MemoryStoreConfig) and config.store.capacity < largest:
        raise ValueError(
            f"store.capacity: {config.store.capacity:,} bytes cannot hold one object of this model "
            f"(its largest is {largest:,} bytes); raise it"
        )


def _run_on(
    config: RunConfig,
    store: Store,
    on_progress: Callable[[EngineTotals, int], None] | None,
    baselines: bool,
) -> RunResult:
    cache = build_cache(config)
    groups = storable_groups(cache.kv)  # refuses an unsupported cache before any work
    _check_an_object_fits(config, cache)
    w = config.workload
    requests = workload.generate(
        seed=w.seed,
        requests=w.requests,
        system_prompts=w.system_prompts,
        system_prompt_tokens=w.system_prompt_tokens,
        user_tokens=w.user_tokens,
        output_tokens=w.output_tokens,
        max_turns=w.max_turns,
        vocab_size=w.vocab_size,
    )
    regions = cache.memory_regions()
    for address, nbytes in regions:
        store.register_buffer(address, nbytes)
    try:
        return _save_and_check(config, store, cache, groups, requests, on_progress, baselines)
    finally:  # a store kept open after the run must not keep the freed cache's memory registered
        for address, _ in regions:
            store.unregister_buffer(address)


def _save_and_check(
    config: RunConfig,
    store: Store,
    cache: SyntheticCache,
    groups: Sequence[StoreGroup],
    requests: Sequence[workload.Request],
    on_progress: Callable[[EngineTotals, int], None] | None,
    baselines: bool,
) -> RunResult:
    """The workload's saves through the pipeline on ``store`` (the cache's memory registered), checked."""
    w = config.workload
    observed: list[tuple[StoreObject, ObjectStatus]] = []
    graph = _save_graph(config, cache.kv, store, lambda record, status: observed.append((record, status)))
    pipeline = SyncPipeline(
        graph, queue_capacity=config.save.queue_capacity, when_full=config.save.when_full, name="save"
    )
    progress = None if on_progress is None else (lambda totals: on_progress(totals, len(requests)))
    engine = Engine(
        cache,
        groups,
        pipeline,
        Pacing(w.concurrency, w.prefill_tokens_per_step, w.decode_tokens_per_step),
        config.model.block_size,
        config.model.num_blocks,
        progress,
        keep_saves=baselines,
    )
    started = time.perf_counter()
    with pipeline:
        totals = engine.run(requests)
    elapsed = time.perf_counter() - started

    objects = final_statuses(observed)
    stored = [
        record for record, status in objects.values() if status in (ObjectStatus.PUT, ObjectStatus.EXISTING)
    ]
    chunks = count_chunks(store, (record for record, _ in objects.values()))
    verification = verify(store, cache, stored)
    bytes_put = sum(record.size for record, status in observed if status is ObjectStatus.PUT)
    measured = None
    if baselines:
        measured = baseline_runs.measure(
            lambda kv, observer: _save_graph(config, kv, store, observer),
            cache.kv,
            store,
            totals.saves,
            stored,
            config.save.queue_capacity,
        )
    # The pipeline's time: the wall time less the generator's CPU time, which a
    # connector in a real engine never pays (the model computes the KV) and which
    # holds a core the pipeline's thread would run on.
    pipeline_s = elapsed - totals.synthetic_s
    report = {
        "store": {
            "kind": config.store.kind,
            "group_ids_supported": store.supports_group_ids,
            "group_semantics": bool(config.save.enable_group_semantics and store.supports_group_ids),
        },
        "requests": len(requests),
        "objects": {
            "considered": totals.counts["considered"],
            "existing": totals.counts["existing"],
            "put": totals.counts["put"],
            "failed": totals.counts["failed"],
            "throttled": totals.counts["throttled"],
            # put with no seal naming them (the put stage's count): a load finds them unverified
            "unsealed": totals.counts["unsealed"],
            "distinct_keys": len(objects),
        },
        "bytes_put": bytes_put,
        "elapsed_s": round(elapsed, 3),
        "put_gbps": _gbps(bytes_put, elapsed),
        "pipeline_gbps": _gbps(bytes_put, pipeline_s),
        "synthetic_kv_s": round(totals.synthetic_s, 3),
        "synthetic_kv_bytes": totals.synthetic_bytes,
        "pipeline_alone": None if measured is None else measured.alone.as_report(),
        "raw_put": None if measured is None else measured.raw.as_report(),
        "pipeline_vs_raw_put": None if measured is None else measured.ratio,
        "chunks": vars(chunks),
        "verify": vars(verification),
        "jobs": {"submitted": totals.save_requests, **dict(totals.outcomes)},
        "backpressure": totals.counts["backpressure"],
        "kv_cache_bytes": cache.nbytes,
        "stages": {name: _stage_report(snapshot.as_dict()) for name, snapshot in pipeline.metrics().items()},
    }
    return RunResult(report, objects)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _save_graph(config: RunConfig, kv: KVCache, store: Store, observer: Any) -> Graph:
    if config.pipeline is None:
        return default_save_graph(
            kv,
            store,
            enable_group_semantics=config.save.enable_group_semantics,
            max_buffers_per_call=config.save.max_buffers_per_call,
            observer=observer,
            integrity=config.save.integrity,
        )
    return build_graph(config.pipeline, KV_STAGES, {"kv": kv, "store": store, "observer": observer})


def _stage_report(snapshot: dict[str, float | int | bool]) -> dict[str, float | int | bool]:
    return {
        key: round(value, 3) if isinstance(value, float) else value
        for key, value in snapshot.items()
        if key != "queue_depth"
    }
