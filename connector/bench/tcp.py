"""tcp: the segment lives in another process, so every put crosses TCP loopback.

Objects of 64 KiB made of 64 per-layer buffers of 1 KiB, as a model with 64
layers' K/V per block would give. Contenders, alternating rounds, every round on
an emptied store, keys and buffers precomputed for the raw loops:
- ``raw multi-buffer``: per request, ``batch_is_exist`` then
  ``batch_put_from_multi_buffers`` (every buffer a transfer of its own);
- ``raw single-buffer``: the same bytes already contiguous, ``batch_put_from``:
  one transfer per object, the limit for this object size;
- ``pipeline``: the default save graph through the sync bridge; ``auto`` gathers
  each object into one staging buffer before the put, and each object is sealed
  (its checksum stored beside it, :mod:`kvpipe.stages.integrity`);
- ``pipeline, integrity off``: the same without seals.
Targets: pipeline >= 5x raw multi-buffer, >= 0.8x raw single-buffer, and >= 0.95x
itself without seals.
"""

from __future__ import annotations

import warnings

from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster
from kvpipe.connector.timing import Timed, alternate, timed

from .kvbench import UNSEALED, BenchCache, MiB, PipelineContender, clear, put_contiguous, put_each
from .peer import remote_segment
from .result import BenchOptions, Target, WorkloadResult, contest_result

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

LAYERS = 64
BUFFER_BYTES = 1024


def run(options: BenchOptions) -> WorkloadResult:
    requests_count, chunks = (4, 8) if options.quick else (64, 16)
    repeats = 1 if options.quick else options.repeats
    cache = BenchCache.build(layers=LAYERS, buffer_bytes=BUFFER_BYTES, num_blocks=requests_count * chunks + 1)
    objects = requests_count * chunks
    total = objects * cache.object_bytes
    contiguous = torch.full((objects, cache.object_bytes), 3, dtype=torch.uint8)
    with LocalMaster() as master:
        assert master.endpoints is not None
        address, metadata = master.endpoints.master_address, master.endpoints.metadata_server
        settings = MooncakeSettings(
            master=address, metadata_server=metadata, global_segment_size=0, local_buffer_size=16 * MiB
        )
        with (
            remote_segment(address, metadata, total + 64 * MiB) as peer,
            MooncakeStore.open(settings) as store,
            cache.registered(store),
            PipelineContender(cache, store) as ours,
            PipelineContender(cache, store, integrity="off") as unsealed,
        ):
            if store.register_buffer(contiguous.data_ptr(), contiguous.nbytes) != 0:
                raise RuntimeError("could not register the contiguous copy")
            requests = cache.requests([chunks] * requests_count, salt="tcp")
            records = [cache.records_of(request) for request in requests]
            flat = [
                ([r.key for r in batch], [contiguous[i * chunks + j].data_ptr() for j in range(len(batch))])
                for i, batch in enumerate(records)
            ]

            # the segment's owner does half of every transfer: its CPU is the contenders' too
            helpers = [peer.pid]

            def raw_multi() -> Timed:
                clear(store)
                return timed(lambda: put_each(store, records), helpers)

            def raw_single() -> Timed:
                clear(store)

                def work() -> None:
                    for keys, addresses in flat:
                        put_contiguous(store, keys, addresses, cache.object_bytes)

                return timed(work, helpers)

            def pipeline() -> Timed:
                clear(store)
                return ours.round(requests, helpers)

            def pipeline_unsealed() -> Timed:
                clear(store)
                return unsealed.round(requests, helpers)

            medians, cores = alternate(
                {
                    "raw multi-buffer": raw_multi,
                    "raw single-buffer": raw_single,
                    "pipeline": pipeline,
                    UNSEALED: pipeline_unsealed,
                },
                repeats,
            )
            store.unregister_buffer(contiguous.data_ptr())
    multi, single, piped = medians["raw multi-buffer"], medians["raw single-buffer"], medians["pipeline"]
    return contest_result(
        workload="tcp",
        description=(
            f"real Mooncake, segment in another process (TCP loopback); {objects} objects of "
            f"{cache.object_bytes // 1024} KiB ({LAYERS} buffers of {BUFFER_BYTES} B); "
            f"median of {repeats} alternating rounds"
        ),
        medians=medians,
        cores=cores,
        rate=("GB/s", total / 1e9),
        baselines=["raw multi-buffer", "raw single-buffer", UNSEALED],
        targets=[
            Target(name="pipeline / raw multi-buffer", measured=multi / piped, goal=5),
            Target(name="pipeline / raw single-buffer", measured=single / piped, goal=0.8),
            Target(
                name=f"pipeline / {UNSEALED} (what seals cost)", measured=medians[UNSEALED] / piped, goal=0.95
            ),
        ],
        options=options,
        parameters={"bytes_per_round": total, "repeats": repeats},
    )
