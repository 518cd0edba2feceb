"""local: puts into the client's own segment (Mooncake's memcpy path), 2 MiB objects.

Each object is 4 per-layer buffers of 512 KiB. Contenders, alternating rounds,
every round on an emptied store:
- ``raw``: per request, ``batch_is_exist`` then ``batch_put_from_multi_buffers``
  of the missing objects, keys and buffers precomputed, one request after another;
- ``pipeline``: the default save graph fed the engine's requests through the sync
  bridge (auto gather leaves buffers this large alone), every object sealed;
- ``pipeline, integrity off``: the same without seals (what a seal costs on an
  object of a real model's size).
Targets: pipeline >= 0.9x raw throughput and >= 0.95x itself without seals.
"""

from __future__ import annotations

from kvpipe.connector.timing import Timed, alternate, timed

from .kvbench import UNSEALED, BenchCache, MiB, PipelineContender, clear, open_local_store, put_each
from .result import BenchOptions, Target, WorkloadResult, contest_result

LAYERS = 4
BUFFER_BYTES = 512 * 1024


def run(options: BenchOptions) -> WorkloadResult:
    requests_count, chunks = (8, 4) if options.quick else (64, 8)
    repeats = 1 if options.quick else options.repeats
    cache = BenchCache.build(layers=LAYERS, buffer_bytes=BUFFER_BYTES, num_blocks=requests_count * chunks + 1)
    total = requests_count * chunks * cache.object_bytes
    with (
        open_local_store(total + 256 * MiB) as store,
        cache.registered(store),
        PipelineContender(cache, store) as ours,
        PipelineContender(cache, store, integrity="off") as unsealed,
    ):
        requests = cache.requests([chunks] * requests_count, salt="local")
        records = [cache.records_of(request) for request in requests]

        def raw() -> Timed:
            clear(store)
            return timed(lambda: put_each(store, records))

        def pipeline() -> Timed:
            clear(store)
            return ours.round(requests)

        def pipeline_unsealed() -> Timed:
            clear(store)
            return unsealed.round(requests)

        medians, cores = alternate({"raw": raw, "pipeline": pipeline, UNSEALED: pipeline_unsealed}, repeats)
    return contest_result(
        workload="local",
        description=(
            f"real Mooncake, own segment; {requests_count} requests x {chunks} objects of "
            f"{cache.object_bytes // MiB} MiB ({LAYERS} buffers); median of {repeats} alternating rounds"
        ),
        medians=medians,
        cores=cores,
        rate=("GB/s", total / 1e9),
        baselines=["raw", UNSEALED],
        targets=[
            Target(name="pipeline / raw throughput", measured=medians["raw"] / medians["pipeline"], goal=0.9),
            Target(
                name=f"pipeline / {UNSEALED} (what seals cost)",
                measured=medians[UNSEALED] / medians["pipeline"],
                goal=0.95,
            ),
        ],
        options=options,
        parameters={"bytes_per_round": total, "repeats": repeats},
    )
