"""The save path run by hand, stage after stage, as the default pipeline wires it.

project -> full / tail -> group_ids -> filter (one batch) -> put (one batch). Tests
that need the stages' joint behaviour (alignment after filtering, byte round
trips) use this instead of the runtime, so a failure points at a stage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvpipe.pipeline.testing import RecordingEmit, batch_of
from kvpipe.stages import (
    FilterStage,
    FullChunksStage,
    GroupIdsParams,
    GroupIdsStage,
    KVCache,
    ProjectStage,
    PutParams,
    PutStage,
    SaveRequest,
    StoreObject,
    TailStage,
    fingerprint,
)
from kvpipe.stages.layers import common_waves


def put_params(**params: Any) -> PutParams:
    """The put stage's params with its slow-store throttle off unless ``params`` name one.

    The throttle reads how long each store call took on the wall clock: a test on a
    busy machine (a garbage collection in the calling thread, a descheduled worker)
    can see a scripted store "slow" and have later calls shed, which no test but the
    throttle's own (with its clock and CPU wait injected) should depend on.
    """
    return PutParams(**{"throttle": None, **params})


@dataclass
class SaveRun:
    records: list[StoreObject]  # every record the collect stages made, with its group id
    counts_by_request: dict[str, Counter[str]]  # every stage's counts, per request, as its job has them
    failures: list[str]

    @property
    def counts(self) -> Counter[str]:
        return sum(self.counts_by_request.values(), Counter())

    def record(self, key: str) -> StoreObject:
        (found,) = {r for r in self.records if r.key == key}
        return found


async def run_save_path(
    kv: KVCache,
    store: Any,
    requests: Iterable[SaveRequest],
    *,
    group_semantics: bool = True,
    put: PutParams | None = None,
    sealed: bool = True,
) -> SaveRun:
    """Save ``requests`` into ``store``; ``put``: the put stage's params (default :func:`put_params`)."""
    project = ProjectStage(kv)
    collectors = {"full": FullChunksStage(kv), "tail": TailStage(kv)}
    group_ids = GroupIdsStage(GroupIdsParams(enable_group_semantics=group_semantics), kv, store)
    emits: list[tuple[str, RecordingEmit]] = []  # (request id, the handle of one of its items)
    named_records = []
    for request in requests:
        await project.process(request, routed := RecordingEmit())
        emits.append((request.request_id, routed))
        for port, collect in collectors.items():
            for projected in routed.emitted[port]:
                await collect.process(projected, collected := RecordingEmit())
                emits.append((request.request_id, collected))
                for records in collected.emitted["out"]:
                    await group_ids.process(records, named := RecordingEmit())
                    emits.append((request.request_id, named))
                    named_records.extend(named.emitted["out"])
    filter_batch = batch_of(named_records)
    await FilterStage(store).process_batch(filter_batch)
    put_batch = batch_of(out for entry in filter_batch for out in entry.emit.emitted["out"])
    put_stage = PutStage(
        put or put_params(), store, fingerprint=fingerprint(kv) if sealed else None, layer_waves=common_waves(kv)
    )
    try:
        await put_stage.process_batch(put_batch)
    finally:  # its seal memory is unregistered: the store outlives this helper
        await put_stage.stop()
    emits += [(entry.item[0].request_id, entry.emit) for entry in (*filter_batch, *put_batch)]
    counts: dict[str, Counter[str]] = {}
    for request_id, emit in emits:
        counts.setdefault(request_id, Counter()).update(emit.counts)
    return SaveRun(
        records=[record for records in named_records for record in records],
        counts_by_request=counts,
        failures=[str(failure) for _, emit in emits for failure in emit.failures],
    )
