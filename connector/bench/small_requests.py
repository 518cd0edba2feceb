"""small-requests: many requests of one or two chunks, half of them stored already.

10,000 requests of 1-2 objects of 16 KiB (4 buffers), into the client's own
segment. Before every round the store is emptied and every other request's
objects are put (untimed), so half of what each contender meets exists.
Contenders, alternating rounds:
- ``sequential``: the per-request design, one thread; per request: collect its
  objects, ``batch_is_exist``, drop the stored ones, put the rest;
- ``raw batched``: the same logic over 64 requests per store call;
- ``pipeline``: the default save graph through the sync bridge, one submit per
  request, as an engine's steps would make them, each object sealed;
- ``pipeline, integrity off``: the same without seals.
Batching alone is worth several times here; targets: pipeline >= 5x sequential,
>= 0.8x raw batched, and >= 0.95x itself without seals.
"""

from __future__ import annotations

from kvpipe.connector.timing import Timed, alternate, timed

from .kvbench import UNSEALED, BenchCache, MiB, PipelineContender, clear, open_local_store, put_records
from .result import BenchOptions, Target, WorkloadResult, contest_result

LAYERS = 4
BUFFER_BYTES = 4096
BATCH_REQUESTS = 64


def run(options: BenchOptions) -> WorkloadResult:
    count = 500 if options.quick else 10_000
    repeats = 1 if options.quick else options.repeats
    chunk_counts = [1 + index % 2 for index in range(count)]
    cache = BenchCache.build(layers=LAYERS, buffer_bytes=BUFFER_BYTES, num_blocks=sum(chunk_counts) + 1)
    total_objects = sum(chunk_counts)
    with (
        open_local_store(total_objects * cache.object_bytes + 256 * MiB) as store,
        cache.registered(store),
        PipelineContender(cache, store) as ours,
        PipelineContender(cache, store, integrity="off") as unsealed,
    ):
        requests = cache.requests(chunk_counts, salt="small")
        stored_half = [record for request in requests[::2] for record in cache.records_of(request)]

        def prepare() -> None:
            clear(store)
            for start in range(0, len(stored_half), 1024):
                put_records(store, stored_half[start : start + 1024])

        def sequential() -> Timed:
            prepare()

            def work() -> None:
                for request in requests:
                    put_records(store, cache.records_of(request))

            return timed(work)

        def raw_batched() -> Timed:
            prepare()

            def work() -> None:
                for start in range(0, count, BATCH_REQUESTS):
                    batch = requests[start : start + BATCH_REQUESTS]
                    put_records(store, [record for request in batch for record in cache.records_of(request)])

            return timed(work)

        def pipeline() -> Timed:
            prepare()
            return ours.round(requests)

        def pipeline_unsealed() -> Timed:
            prepare()
            return unsealed.round(requests)

        medians, cores = alternate(
            {
                "sequential": sequential,
                "raw batched": raw_batched,
                "pipeline": pipeline,
                UNSEALED: pipeline_unsealed,
            },
            repeats,
        )
    sequential_s, batched_s, pipeline_s = medians["sequential"], medians["raw batched"], medians["pipeline"]
    return contest_result(
        workload="small-requests",
        description=(
            f"real Mooncake, own segment; {count:,} requests of 1-2 objects of {cache.object_bytes // 1024} KiB, "
            f"half stored already; median of {repeats} alternating rounds"
        ),
        medians=medians,
        cores=cores,
        rate=("requests/s", count),
        baselines=["sequential", "raw batched", UNSEALED],
        targets=[
            Target(name="pipeline / sequential", measured=sequential_s / pipeline_s, goal=5),
            Target(name="pipeline / raw batched", measured=batched_s / pipeline_s, goal=0.8),
            Target(
                name=f"pipeline / {UNSEALED} (what seals cost)",
                measured=medians[UNSEALED] / pipeline_s,
                goal=0.95,
            ),
        ],
        options=options,
        parameters={"requests": count, "objects": total_objects, "repeats": repeats},
    )
