"""KV events for KV-aware routers: what kvpipe stored, and what it found gone, in vLLM's own events.

A router (Dynamo, llm-d) that sees an engine's blocks through vLLM's KV-event
publisher (``kv_events_config``) learns from these which prefixes the engine can
load from the store. They go out through vLLM's publisher, as vLLM's engine-core
events do:

- **BlockStored**, one per storable group of a chunk (``group_idx``: the engine's
  KV-cache group, as vLLM's own events number it), once *every rank that puts*
  has reported every object it planned for that chunk stored or already there.
  It carries what vLLM's engine events carry: the chunk's block hash (converted
  as vLLM converts its own, so a router matches the two), its parent, the
  chunk's token ids, LoRA. A chunk is only worth a hit whole, so an event before
  the last rank reports would send requests to a load that cannot happen.
- **BlockRemoved** when kvpipe finds an announced chunk gone: a lookup answers
  "absent" for one of its objects (Mooncake evicted it, a node died, another
  deployment reset it), or a load of it failed (gone between lookup and load).

Every event names the deployment's shared pool as its ``ownership``
(:func:`~kvpipe.stages.shared_pool_id`): a chunk in the store is no engine's own, and
vLLM's router (``kv_aware``) files an event with an ``ownership`` under that pool at
its external tier (credited ``--kv-penalty-external``), where an event without one
would be the writer's own host-memory blocks (``--kv-penalty-host``), credited to the
writer alone. The router credits a pool's chunk to the worker whose event stream
carried it, so a chunk one replica stored is reachable through every other replica
only if every replica's stream carries it: ``kvpipe fleet`` relays the pool's events
to every replica's router stream (:mod:`kvpipe.connector.fleet.pool_relay`).

The medium is vLLM's ``MEDIUM_CPU``: Mooncake keeps objects in host DRAM segments,
which is what the CPU tier means to vLLM's own offloading events; ``MEDIUM_STORAGE``
names a disk tier (vLLM's simple offload uses it only with a disk capacity).
(vLLM's ``MooncakeStoreConnector`` sends ``"cpu"``, which matches none of vLLM's
constants and which Dynamo's parser does not recognise.) A scoped reset publishes
nothing of its own: vLLM's prefix-cache reset that calls it publishes
``AllBlocksCleared`` for the engine.

The split: each worker's :class:`ChunkReporter` turns its save jobs' object
statuses into one :data:`~.messages.ChunkReport` per chunk; the scheduler's
:class:`ChunkAnnouncer`, which planned the saves and so knows their tokens, counts
the reports and publishes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import BlockHash, ExternalBlockHash, maybe_convert_block_hash

from kvpipe.stages import LoadRequest, ObjectStatus, SaveRequest, StoreObject, chunk_hash_at
from kvpipe.stages.chunks import Chunk
from kvpipe.stages.load_plan import load_chunks
from kvpipe.stages.model import StoreGroup

from .messages import ChunkReport, Rank, chunk_settled

if TYPE_CHECKING:
    from vllm.v1.request import Request

MEDIUM = MEDIUM_CPU
#: Chunks planned and not fully reported yet, at most; the oldest are given up past it
#: (a save that never ended: a job past its deadline reports nothing).
PENDING_LIMIT = 4096
#: Announced chunks remembered, so a lookup that finds one absent can say it is gone
#: (the oldest are forgotten first: a router ages its entries out anyway).
ANNOUNCED_LIMIT = 65536

STORED = (ObjectStatus.PUT, ObjectStatus.EXISTING)


class ChunkReporter:
    """One rank's save outcomes, per chunk: stored whole (every object planned) or not.

    ``observed`` runs on the save pipeline's thread for every object; ``planned``,
    ``ended`` and ``take`` on the engine's.
    """

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self._statuses: dict[tuple[str, int, bytes], ObjectStatus] = {}
        self._jobs: dict[int, tuple[str, dict[bytes, list[int]]]] = {}
        self._reports: list[ChunkReport] = []
        self._lock = threading.Lock()

    def planned(self, job_id: int, request_id: str, chunks: Iterable[Chunk]) -> None:
        by_hash: dict[bytes, list[int]] = {}
        for chunk in chunks:
            by_hash.setdefault(chunk.chunk_hash, []).append(chunk.group.store_group)
        self._jobs[job_id] = (request_id, by_hash)

    def observed(self, record: StoreObject, status: ObjectStatus) -> None:
        with self._lock:
            self._statuses[(record.request_id, record.store_group, record.chunk_hash)] = status

    def ended(self, job_id: int) -> None:
        """The job is over: a report per chunk (one never told a status did not store)."""
        planned = self._jobs.pop(job_id, None)
        if planned is None:
            return
        request_id, by_hash = planned
        tp, pp = self.rank
        with self._lock:
            for chunk_hash, groups in by_hash.items():
                statuses = [self._statuses.pop((request_id, group, chunk_hash), None) for group in groups]
                self._reports.append((tp, pp, chunk_hash, all(status in STORED for status in statuses)))

    def dropped(self, chunks: Iterable[Chunk]) -> None:
        """A save that never started (no staging room): its chunks were not stored."""
        tp, pp = self.rank
        self._reports.extend((tp, pp, chunk_hash, False) for chunk_hash in {c.chunk_hash for c in chunks})

    def take(self) -> list[ChunkReport]:
        with self._lock:
            reports, self._reports = self._reports, []
        return reports


@dataclass
class _Pending:
    events: list[BlockStored]  # one per storable group of the chunk
    reported: set[Rank] = field(default_factory=set)


class ChunkAnnouncer:
    """The scheduler's side: events for the chunks every putting rank stored, and for loads that failed."""

    def __init__(
        self,
        groups: Sequence[StoreGroup],
        hash_block_size: int,
        ranks: Iterable[Rank],
        pool: str | None = None,
        limit: int = PENDING_LIMIT,
    ) -> None:
        """``pool``: the ``ownership`` every event carries (the deployment's shared pool)."""
        self.groups = tuple(groups)
        self.pool = pool
        self.hash_block_size = hash_block_size
        self.ranks = frozenset(ranks)
        self._limit = limit
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()
        self._announced: OrderedDict[bytes, tuple[int | None, ...]] = (
            OrderedDict()
        )  # chunk hash -> engine groups
        self._ready: list[KVCacheEvent] = []
        self.given_up = 0  # chunks dropped from the pending set for want of room

    def expect(self, request: Request, save: SaveRequest, chunks: Iterable[Chunk]) -> None:
        """Remember what a planned save will store (``chunks``: its :func:`~kvpipe.stages.chunks_to_save`),
        to announce it once every rank reports."""
        lora = request.lora_request
        hbs = self.hash_block_size
        for chunk in chunks:
            pending = self._pending.get(chunk.chunk_hash)
            if pending is None:
                pending = self._pending[chunk.chunk_hash] = _Pending([])
            elif any(e.group_idx == chunk.group.engine_group for e in pending.events):
                continue  # another request's save of the same chunk: expected already
            start = chunk.tokens_start
            parent = chunk_hash_at(save.block_hashes, start, hbs) if start else None
            tokens = list(request.all_token_ids[start : chunk.tokens_end])
            # a chunk's hash is the vLLM block hash it ends with: BlockHash() says so to mypy
            event = BlockStored(
                block_hashes=[maybe_convert_block_hash(BlockHash(chunk.chunk_hash))],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(BlockHash(parent)),
                token_ids=tokens,
                block_size=len(tokens),
                lora_id=lora.adapter_id if lora else None,
                medium=MEDIUM,
                lora_name=lora.name if lora else None,
                group_idx=chunk.group.engine_group,
                ownership=self.pool,
            )
            pending.events.append(event)
        while len(self._pending) > self._limit:
            self._pending.popitem(last=False)
            self.given_up += 1

    def reported(self, reports: Iterable[ChunkReport]) -> None:
        for report in reports:
            chunk_hash = report[2]
            pending = self._pending.get(chunk_hash)
            if pending is None:
                continue
            settled = chunk_settled(pending.reported, report, self.ranks)
            if settled is not None:
                del self._pending[chunk_hash]
            if settled:
                self._ready.extend(pending.events)
                self._announced[chunk_hash] = tuple(e.group_idx for e in pending.events)
                self._announced.move_to_end(chunk_hash)
                if len(self._announced) > ANNOUNCED_LIMIT:
                    self._announced.popitem(last=False)

    def found_absent(self, chunk_hashes: Iterable[bytes]) -> None:
        """A lookup found these chunks' objects absent: BlockRemoved for the announced ones."""
        gone: dict[int | None, list[ExternalBlockHash]] = {}
        for chunk_hash in chunk_hashes:
            for group in self._announced.pop(chunk_hash, ()):
                gone.setdefault(group, []).append(maybe_convert_block_hash(BlockHash(chunk_hash)))
        self._removed(gone)

    def load_failed(self, load: LoadRequest, failed_block_ids: set[int] | None) -> None:
        """BlockRemoved for the chunks of a failed load (``failed_block_ids`` None: all of them)."""
        try:
            chunks = load_chunks(self.groups, self.hash_block_size, load)
        except ValueError:
            return  # a load the stage refused: nothing was found gone
        gone: dict[int | None, list[ExternalBlockHash]] = {}
        for chunk in chunks:
            if failed_block_ids is None or chunk.block_id in failed_block_ids:
                self._announced.pop(chunk.chunk_hash, None)
                gone.setdefault(chunk.group.engine_group, []).append(
                    maybe_convert_block_hash(BlockHash(chunk.chunk_hash))
                )
        self._removed(gone)

    def _removed(self, gone: dict[int | None, list[ExternalBlockHash]]) -> None:
        self._ready.extend(
            BlockRemoved(block_hashes=hashes, medium=MEDIUM, group_idx=group, ownership=self.pool)
            for group, hashes in gone.items()
        )

    def forget(self) -> None:
        """A reset: nothing planned before it will be announced (vLLM's reset cleared the rest)."""
        self._pending.clear()
        self._announced.clear()

    def take(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready, []
        return ready
