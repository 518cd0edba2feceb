"""A stand-in for the inference engine: it runs requests in steps and saves their KV.

Like vLLM's scheduler it admits requests while blocks are free, computes each
running request a slice at a time (prefill in chunks, then decode), and hands the
save pipeline a :class:`SaveRequest` whenever a request completes chunks and once
more when it finishes (its partial tail). A request's blocks go back to the pool
only when it is finished AND every save job it submitted has ended: the pipeline
reads the blocks asynchronously, and a block reused too early would be stored
with another request's bytes (the run's read-back verification would see it).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpipe.pipeline import Job, SyncPipeline
from kvpipe.stages import SaveRequest, StoreGroup, chunks_to_save

from .synthetic import SyntheticCache
from .workload import Request, chain_hashes


class BlockPool:
    """Free block ids per engine group; block 0 is reserved (the engine's null block)."""

    def __init__(self, groups: int, num_blocks: int) -> None:
        self._free = [list(range(num_blocks - 1, 0, -1)) for _ in range(groups)]
        self.capacity = num_blocks - 1

    def allocate(self, counts: Sequence[int]) -> tuple[tuple[int, ...], ...] | None:
        if any(len(free) < count for free, count in zip(self._free, counts, strict=True)):
            return None
        return tuple(
            tuple(free.pop() for _ in range(count)) for free, count in zip(self._free, counts, strict=True)
        )

    def release(self, block_ids: Sequence[Sequence[int]]) -> None:
        for free, ids in zip(self._free, block_ids, strict=True):
            free.extend(ids)


@dataclass
class _Live:
    request: Request
    hashes: list[bytes]
    block_ids: tuple[tuple[int, ...], ...]
    computed: int = 0
    saved: int = 0
    open_jobs: int = 0
    finished: bool = False


@dataclass
class EngineTotals:
    """What the engine saw come back from the pipeline."""

    counts: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    requests_finished: int = 0
    save_requests: int = 0
    # Writing the synthetic KV bytes, the workload's work and not the pipeline's: the CPU
    # time of the engine's thread, since its wall time also holds the waits for the GIL
    # while the pipeline's thread runs, which are the pipeline's.
    synthetic_s: float = 0.0
    synthetic_bytes: int = 0  # the bytes written in that time
    saves: list[SaveRequest] = field(default_factory=list)  # every request submitted (``keep_saves``)


@dataclass(frozen=True)
class Pacing:
    concurrency: int
    prefill_tokens_per_step: int
    decode_tokens_per_step: int


class Engine:
    def __init__(
        self,
        cache: SyntheticCache,
        groups: Sequence[StoreGroup],
        pipeline: SyncPipeline,
        pacing: Pacing,
        block_size: int,
        num_blocks: int,
        on_progress: Callable[[EngineTotals], None] | None = None,
        keep_saves: bool = False,
    ) -> None:
        """``keep_saves``: keep every save request in :attr:`EngineTotals.saves` (for a replay)."""
        self._cache = cache
        self._groups = groups
        self._pipeline = pipeline
        self._pacing = pacing
        self._block_size = block_size
        self._hash_block_size = cache.kv.hash_block_size
        self._pool = BlockPool(len(cache.kv.groups), num_blocks)
        self._on_progress = on_progress
        self._keep_saves = keep_saves
        self._live: dict[str, _Live] = {}
        self.totals = EngineTotals()

    def run(self, requests: Sequence[Request]) -> EngineTotals:
        self._check_fits(requests)
        pending = deque(requests)
        running: list[_Live] = []
        while pending or self._live:
            while pending and len(running) < self._pacing.concurrency and (live := self._admit(pending[0])):
                pending.popleft()
                running.append(live)
            self._save([save for live in running if (save := self._step(live)) is not None])
            running = [live for live in running if not live.finished]
            self._settle(self._pipeline.completed())
            if not running and self._live:
                # Everything left waits on saves still in flight: their blocks are held.
                self._settle([job] if (job := self._pipeline.next_completed(timeout_s=1.0)) else [])
            if self._on_progress is not None:
                self._on_progress(self.totals)
        return self.totals

    def _check_fits(self, requests: Sequence[Request]) -> None:
        longest = max((len(r.tokens) for r in requests), default=0)
        needed = math.ceil(longest / self._block_size)
        if needed > self._pool.capacity:
            raise ValueError(
                f"model.num_blocks: {self._pool.capacity + 1} blocks cannot hold the longest request "
                f"({longest} tokens need {needed} blocks of {self._block_size}); raise it or shorten the workload"
            )

    def _admit(self, request: Request) -> _Live | None:
        blocks = math.ceil(len(request.tokens) / self._block_size)
        block_ids = self._pool.allocate([blocks] * len(self._cache.kv.groups))
        if block_ids is None:
            return None
        live = _Live(request, chain_hashes(request.tokens, self._hash_block_size), block_ids)
        self._live[request.request_id] = live
        return live

    def _step(self, live: _Live) -> SaveRequest | None:
        """Compute the next slice of ``live``; the save it makes (new chunks, or its end), if any."""
        prompt, total = len(live.request.prompt), len(live.request.tokens)
        before = live.computed
        if before < prompt:
            live.computed = min(prompt, before + self._pacing.prefill_tokens_per_step)
        else:
            live.computed = min(total, before + self._pacing.decode_tokens_per_step)
        live.finished = live.computed == total
        bs = self._block_size
        if not (live.computed // bs > before // bs or live.finished):
            return None
        request = SaveRequest(
            request_id=live.request.request_id,
            block_hashes=tuple(live.hashes[: live.computed // self._hash_block_size]),
            block_ids=live.block_ids,
            num_computed_tokens=live.computed,
            num_saved_tokens=live.saved,
            finished=live.finished,
        )
        live.saved = live.computed
        live.open_jobs += 1
        return request

    def _save(self, requests: Sequence[SaveRequest]) -> None:
        """Write the KV of a step's saves, then submit them: like an engine, a whole step's forward first."""
        self._write_kv(requests)
        for request in requests:
            self.totals.save_requests += 1
            if self._keep_saves:
                self.totals.saves.append(request)
            self._pipeline.submit(request)

    def _write_kv(self, requests: Sequence[SaveRequest]) -> None:
        """Compute (fill) the blocks these saves offer: new complete chunks, and tails at the end.

        The chunks come from the save stages' own arithmetic, so the engine fills
        exactly the blocks the pipeline will read; all of a step's blocks of one
        group and rank are filled in one call (whose torch ops run on this thread, so
        its CPU time is all of theirs).
        """
        started = time.thread_time()
        by_group: dict[int, dict[int, bytes]] = {}
        for request in requests:
            for chunk in chunks_to_save(request, self._groups, self._hash_block_size):
                by_group.setdefault(chunk.group.engine_group, {})[chunk.block_id] = chunk.chunk_hash
        for engine_group, blocks in by_group.items():
            for rank, shard in enumerate(self._cache.kv.shards):
                self._cache.fill_blocks(rank, engine_group, list(blocks), list(blocks.values()))
                self.totals.synthetic_bytes += len(blocks) * shard.layouts[engine_group].object_size
        self.totals.synthetic_s += time.thread_time() - started

    def _settle(self, jobs: Sequence[Job]) -> None:
        for job in jobs:
            self.totals.counts.update(job.counts)
            self.totals.outcomes[str(job.outcome)] += 1
            live = self._live[job.item.request_id]
            live.open_jobs -= 1
            if live.finished and live.open_jobs == 0:
                self._pool.release(live.block_ids)
                del self._live[live.request.request_id]
                self.totals.requests_finished += 1
