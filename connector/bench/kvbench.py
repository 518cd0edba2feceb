"""What the store workloads share: a KV cache in real memory, requests, and the contenders.

Every contender gets the same requests over the same memory. The raw loops get
their records (keys and buffers) from ``records_of``, built by the same
:class:`~kvpipe.stages.RecordMaker` the pipeline's collect stage uses, so both send
identical objects: precomputed outside the timing in ``local`` and ``tcp``, made in
the loop in ``small-requests`` (as its per-request designs would). The pipeline
starts from the engine's :class:`SaveRequest`, as a connector would.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.protocol import Store
from kvpipe.connector.timing import Timed, timed
from kvpipe.pipeline import Job, SyncPipeline
from kvpipe.stages import (
    EXISTS,
    BlockLayout,
    GroupKind,
    GroupSpec,
    KeyNamespace,
    KVCache,
    RecordMaker,
    Region,
    SaveRequest,
    Shard,
    StoreGroup,
    StoreObject,
    default_save_graph,
    full_chunks,
    storable_groups,
)

with warnings.catch_warnings():  # this CPU torch build warns at import that numpy is absent
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

MiB = 1 << 20
BLOCK_TOKENS = 16


class BenchError(RuntimeError):
    """A contender did not store what it was given: its time would mean nothing."""


@dataclass
class BenchCache:
    """``layers`` tensors of ``num_blocks`` blocks of ``buffer_bytes``: one buffer per layer per object."""

    kv: KVCache
    tensors: list[torch.Tensor]

    @classmethod
    def build(
        cls, *, layers: int, buffer_bytes: int, num_blocks: int, model: str = "bench-model"
    ) -> BenchCache:
        # Filled, not just allocated, so no contender pays the first touch of the pages.
        tensors = [
            torch.full((num_blocks, buffer_bytes), layer + 1, dtype=torch.uint8) for layer in range(layers)
        ]
        layout = BlockLayout(tuple(Region(t.data_ptr(), buffer_bytes) for t in tensors))
        spec = GroupSpec(GroupKind.FULL_ATTENTION, block_size=BLOCK_TOKENS)
        kv = KVCache((spec,), BLOCK_TOKENS, (Shard(KeyNamespace(model), {0: layout}),))
        return cls(kv, tensors)

    @property
    def num_blocks(self) -> int:
        return self.tensors[0].shape[0]

    @property
    def object_bytes(self) -> int:
        return sum(t.shape[1] for t in self.tensors)

    @contextmanager
    def registered(self, store: Store) -> Iterator[None]:
        for tensor in self.tensors:
            _check(store.register_buffer(tensor.data_ptr(), tensor.nbytes), "register_buffer")
        try:
            yield
        finally:
            for tensor in self.tensors:
                store.unregister_buffer(tensor.data_ptr())

    def requests(self, chunk_counts: Sequence[int], *, salt: str) -> list[SaveRequest]:
        """One request per entry, with that many full chunks of its own (fresh hashes per ``salt``)."""
        requests = []
        block = 1
        for index, chunks in enumerate(chunk_counts):
            hashes = tuple(
                hashlib.blake2b(f"{salt}/{index}/{c}".encode(), digest_size=16).digest()
                for c in range(chunks)
            )
            ids = tuple((block + c) % self.num_blocks for c in range(chunks))
            block += chunks
            requests.append(
                SaveRequest(f"{salt}-{index}", hashes, (ids,), num_computed_tokens=chunks * BLOCK_TOKENS)
            )
        return requests

    @functools.cached_property
    def store_groups(self) -> tuple[StoreGroup, ...]:
        """Projected once, as the pipeline's project stage does at build time."""
        return storable_groups(self.kv)

    def records_of(self, request: SaveRequest) -> tuple[StoreObject, ...]:
        """The objects of ``request``, as the collect stage makes them."""
        hash_block_size = self.kv.hash_block_size
        chunks = [
            chunk for group in self.store_groups for chunk in full_chunks(request, group, hash_block_size)
        ]
        return self._records.records(chunks, request.request_id)

    @functools.cached_property
    def _records(self) -> RecordMaker:
        return RecordMaker(self.kv.shards, self.store_groups)


#: the save pipeline without seals (``integrity: off``), beside the default one: what seals cost
UNSEALED = "pipeline, integrity off"


class PipelineContender:
    """The default save pipeline on the sync bridge, started once and fed round after round.

    Long-lived like a connector's: what a round measures is moving requests,
    not starting threads or allocating the staging pool. Without the slow-store
    throttle: the raw loops put every object, so the pipeline must too (a throttled
    round would store less and read faster).
    """

    def __init__(
        self, cache: BenchCache, store: Store, *, gather: str = "auto", integrity: str = "verify"
    ) -> None:
        graph = default_save_graph(cache.kv, store, gather=gather, throttle=None, integrity=integrity)
        self._bridge = SyncPipeline(graph, queue_capacity=16384, keep_completed=False)

    def __enter__(self) -> PipelineContender:
        self._bridge.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bridge.stop(deadline_s=60)

    def round(self, requests: Sequence[SaveRequest], helpers: Sequence[int] = ()) -> Timed:
        """From the first submit to the last job's end (``helpers``: as :func:`.timing.timed`'s).

        :raises BenchError: an object failed.
        """
        jobs: list[Job] = []

        def work() -> None:
            jobs.extend(self._bridge.submit(request) for request in requests)
            for job in jobs:
                job.wait()

        elapsed = timed(work, helpers)
        failed = sum(job.counts["failed"] for job in jobs)
        if failed:
            first = next(job.first_error for job in jobs if job.counts["failed"])
            raise BenchError(f"the pipeline failed {failed} objects, e.g. {first}")
        return elapsed


def put_each(store: Store, batches: Sequence[Sequence[StoreObject]]) -> None:
    """The raw loop the contenders time: :func:`put_records` per batch, one after another."""
    for batch in batches:
        put_records(store, batch)


def put_records(store: Store, records: Sequence[StoreObject]) -> None:
    """The raw logic for one batch: ask which exist, put the rest from their buffers."""
    keys = [record.key for record in records]
    missing = [
        record for record, exists in zip(records, store.batch_is_exist(keys), strict=True) if exists != EXISTS
    ]
    if missing:
        codes = store.batch_put_from_multi_buffers(
            [r.key for r in missing],
            [[b.address for b in r.buffers] for r in missing],
            [[b.size for b in r.buffers] for r in missing],
            store.new_replicate_config(),
        )
        _check_all(codes, "batch_put_from_multi_buffers")


def put_contiguous(store: Store, keys: Sequence[str], addresses: Sequence[int], size: int) -> None:
    """The raw logic with one contiguous buffer per object (the single-buffer limit)."""
    missing = [
        (key, address)
        for key, address, exists in zip(keys, addresses, store.batch_is_exist(keys), strict=True)
        if exists != EXISTS
    ]
    if missing:
        codes = store.batch_put_from(
            [key for key, _ in missing],
            [a for _, a in missing],
            [size] * len(missing),
            store.new_replicate_config(),
        )
        _check_all(codes, "batch_put_from")


def open_local_store(segment_bytes: int) -> MooncakeStore:
    """A spawned master and one client whose own segment receives every put (memcpy path)."""
    return MooncakeStore.open(MooncakeSettings(global_segment_size=segment_bytes, local_buffer_size=16 * MiB))


def clear(store: MooncakeStore) -> None:
    """Remove every object between rounds, so each round stores from scratch (leased ones too)."""
    store.remove_all(force=True)


def _check(code: int, what: str) -> None:
    if code != 0:
        raise BenchError(f"{what} returned {code}")


def _check_all(codes: Sequence[int], what: str) -> None:
    bad = [code for code in codes if code not in (0, -705)]
    if bad:
        raise BenchError(f"{what} refused {len(bad)} of {len(codes)} objects, e.g. code {bad[0]}")
