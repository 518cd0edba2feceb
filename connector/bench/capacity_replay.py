"""Replaying a reuse trace against a real store, the way each connector touches it.

What a store evicts depends on more than its policy: on which objects each
connector *reads* (every read grants a lease, and a leased object cannot be
evicted), how it names and groups them, and what else it writes. So each
contender here makes exactly its connector's store calls, request by request:

- :class:`KvpipeReplay` runs kvpipe's own pieces: the scheduler's lookup rule
  (:class:`~kvpipe.stages.LookupPlan`, one ``batch_is_exist`` per scheduling step
  over every waiting request), the default load graph (seals checked) and the
  default save graph (filter, seals, group ids as configured), through the sync
  bridge a connector uses; with retention, the scheduler's count of requests per
  chunk marks the chunks to pin, and the put stage pins them within its budget.
- :class:`VllmReplay` makes the calls vLLM 0.32's ``MooncakeStoreConnector`` makes
  (read from its sources: ``mooncake/store/scheduler.py`` and ``worker.py``): a
  lookup of every chunk of the prompt when the request reaches the head of the
  queue, a get of the hit, and a save that first asks ``batch_is_exist`` for every
  chunk from token 0 (its save position starts there even after a hit) and puts
  the missing ones, no group ids, no seals, no pins.

Requests arrive in batches; a batch is served one request per scheduling step
(the others wait, and are looked up again where the connector does so), and a
batch takes a fixed period of wall time, so leases (a wall-clock TTL in the master)
age the same way in every contender.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.pipeline import SyncPipeline
from kvpipe.stages import (
    EXISTS,
    LoadRequest,
    LookupPlan,
    LookupRequest,
    SaveRequest,
    default_load_graph,
    default_save_graph,
    object_key,
)
from kvpipe.stages.retention import LoadedKeys, ReuseCounter

from .kvbench import BLOCK_TOKENS, BenchCache
from .reuse_trace import Trace

#: requests that arrive together (vLLM's prefix cache was reset after each such batch in the engine runs)
BATCH = 10


@dataclass(frozen=True, slots=True)
class Prompt:
    """A trace request as an engine sees it: chained block hashes, one per chunk, and its blocks."""

    request_id: str
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]

    @property
    def tokens(self) -> int:
        # one token past the last whole chunk, as a real prompt ends (a hit never reaches num_tokens)
        return len(self.block_hashes) * BLOCK_TOKENS + 1


def prompts(trace: Trace, cache: BenchCache) -> list[Prompt]:
    """The trace's requests with hashes chained over their prefix (shared) then their own suffix."""
    chunks = trace.prefix_chunks + trace.suffix_chunks
    if chunks >= cache.num_blocks:
        raise ValueError(f"a prompt of {chunks} chunks needs more than the cache's {cache.num_blocks} blocks")
    made = []
    for request in trace.requests:
        hashes: list[bytes] = []
        parent = b""
        for index in range(chunks):
            # a prefix's chunks are the same in every request that shares it; a suffix's are its own
            name = request.prefix if index < trace.prefix_chunks else f"suffix-{request.index}"
            parent = hashlib.blake2b(parent + f"{name}/{index}".encode(), digest_size=16).digest()
            hashes.append(parent)
        made.append(Prompt(f"r{request.index}", tuple(hashes), tuple(range(1, 1 + chunks))))
    return made


@dataclass
class Tally:
    """What a replay got: chunks hit (and loaded), objects put, puts refused for lack of space."""

    hit_chunks: int = 0
    load_failed_chunks: int = 0
    puts_refused: int = 0
    objects_put: int = 0
    removed: int = 0  # objects the connector removed itself (demoted pins)
    overran_periods: int = 0
    counts: dict[str, int] = field(default_factory=dict)


class Replay(Protocol):
    """One connector's store calls for a stream of requests."""

    tally: Tally

    def arrive(self, batch: Sequence[Prompt]) -> None:
        """``batch`` reaches the engine (vLLM tells a connector of each new request)."""

    def step(self, serving: Prompt, waiting: Sequence[Prompt]) -> None:
        """A scheduling step that serves ``serving`` (lookup, load, compute, save) while ``waiting`` wait."""


def evictions(tally: Tally, trace: Trace, cache: BenchCache, store: MooncakeStore) -> int:
    """The objects the store evicted during a replay: put, neither still there nor removed by the connector.

    Every contender names objects by the same keys (kvpipe's objects are vLLM's),
    so one ``batch_is_exist`` over every chunk of the trace counts what is left.
    """
    namespace = cache.kv.shards[0].namespace
    hashes = dict.fromkeys(h for prompt in prompts(trace, cache) for h in prompt.block_hashes)
    keys = [object_key(namespace, 0, h) for h in hashes]
    left = sum(1 for answer in store.batch_is_exist(keys) if answer == EXISTS)
    return tally.objects_put - tally.removed - left


def replay(contender: Replay, trace: Trace, cache: BenchCache, period_s: float) -> Tally:
    """Serve ``trace`` batch by batch, each batch taking ``period_s`` of wall time at least."""
    every = prompts(trace, cache)
    for start in range(0, len(every), BATCH):
        began = time.monotonic()
        batch = every[start : start + BATCH]
        contender.arrive(batch)
        for position, prompt in enumerate(batch):
            contender.step(prompt, batch[position + 1 :])
        left = period_s - (time.monotonic() - began)
        if left > 0:
            time.sleep(left)
        else:
            contender.tally.overran_periods += 1
    return contender.tally


class KvpipeReplay(AbstractContextManager["KvpipeReplay"]):
    """kvpipe's connector, store-side: its lookup rule, its load graph, its save graph."""

    def __init__(
        self,
        cache: BenchCache,
        store: MooncakeStore,
        *,
        integrity: str = "verify",
        enable_group_semantics: bool = False,
        max_pinned_bytes: int = 0,
    ) -> None:
        """``max_pinned_bytes``: retention's budget (0: retention off, no request counted)."""
        self._cache = cache
        self._store = store
        self.tally = Tally()
        self._failed: dict[str, frozenset[int]] = {}
        self._reuse = ReuseCounter() if max_pinned_bytes else None
        loaded_keys = LoadedKeys() if max_pinned_bytes else None
        self._save = SyncPipeline(
            default_save_graph(
                cache.kv,
                store,
                throttle=None,
                integrity=integrity,
                enable_group_semantics=enable_group_semantics,
                max_pinned_bytes=max_pinned_bytes,
                loaded_keys=loaded_keys,
            ),
            keep_completed=False,
        )
        self._load = SyncPipeline(
            default_load_graph(
                cache.kv, store, self._load_failed, integrity=integrity, loaded_keys=loaded_keys
            ),
            keep_completed=False,
        )

    def __enter__(self) -> KvpipeReplay:
        self._save.start()
        self._load.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._load.stop(deadline_s=60)
        self._save.stop(deadline_s=60)

    def arrive(self, batch: Sequence[Prompt]) -> None:
        if self._reuse is not None:  # the scheduler counts each request as it arrives
            for prompt in batch:
                self._reuse.asked(prompt.block_hashes)

    def _load_failed(self, request: LoadRequest, failed_block_ids: frozenset[int]) -> None:
        self._failed[request.request_id] = failed_block_ids

    def _lookup(self, prompt: Prompt) -> LookupRequest:
        return LookupRequest(prompt.request_id, prompt.block_hashes, prompt.tokens)

    def _plan(self, prompt: Prompt) -> LookupPlan:
        cache = self._cache
        return LookupPlan(cache.store_groups, cache.kv.shards, cache.kv.hash_block_size, self._lookup(prompt))

    def step(self, serving: Prompt, waiting: Sequence[Prompt]) -> None:
        # the scheduler's one batch_is_exist of the step asks for every waiting request too
        plan = self._plan(serving)
        ahead = (self._plan(prompt).keys for prompt in waiting)
        asked = list(dict.fromkeys(key for keys in (plan.keys, *ahead) for key in keys))
        exists = {
            key: answer == EXISTS
            for key, answer in zip(asked, self._store.batch_is_exist(asked), strict=True)
        }
        hit = plan.hit(exists)
        loaded = self._load_hit(serving, hit)
        job = self._save.submit(
            SaveRequest(
                serving.request_id,
                serving.block_hashes,
                (serving.block_ids,),
                num_computed_tokens=len(serving.block_hashes) * BLOCK_TOKENS,
                num_saved_tokens=loaded,
                finished=True,
                reused_chunks=self._reuse.reused(serving.block_hashes) if self._reuse is not None else {},
            )
        )
        job.wait()
        self.tally.objects_put += job.counts.get("put", 0)
        self.tally.puts_refused += job.counts.get("failed", 0)
        self.tally.removed += job.counts.get("demoted", 0)
        _merge(self.tally.counts, job.counts)

    def _load_hit(self, prompt: Prompt, hit: int) -> int:
        """Load ``hit`` tokens; the tokens loaded whole from token 0 (what the engine is spared)."""
        if not hit:
            return 0
        self._load.submit(
            LoadRequest(prompt.request_id, prompt.block_hashes, (prompt.block_ids,), 0, hit)
        ).wait()
        failed = self._failed.pop(prompt.request_id, frozenset())
        good = 0
        for block_id in prompt.block_ids[: hit // BLOCK_TOKENS]:
            if block_id in failed:
                break
            good += 1
        self.tally.hit_chunks += good
        self.tally.load_failed_chunks += hit // BLOCK_TOKENS - good
        return good * BLOCK_TOKENS


class VllmReplay:
    """vLLM 0.32's ``MooncakeStoreConnector``, store-side (see the module docstring)."""

    def __init__(self, cache: BenchCache, store: MooncakeStore) -> None:
        self._cache = cache
        self._store = store
        self._namespace = cache.kv.shards[0].namespace
        self.tally = Tally()

    def _records(self, prompt: Prompt) -> list[tuple[str, list[int], list[int]]]:
        layout = self._cache.kv.shards[0].layouts[0]
        made = []
        for chunk_hash, block_id in zip(prompt.block_hashes, prompt.block_ids, strict=True):
            buffers = layout.buffers(block_id)
            made.append(
                (
                    object_key(self._namespace, 0, chunk_hash),
                    [b.address for b in buffers],
                    [b.size for b in buffers],
                )
            )
        return made

    def arrive(self, batch: Sequence[Prompt]) -> None:
        pass  # it keeps no count of requests

    def step(self, serving: Prompt, waiting: Sequence[Prompt]) -> None:
        records = self._records(serving)
        # lookup: every chunk of the prompt, not stopping at the first miss
        answers = self._store.batch_is_exist([key for key, _, _ in records])
        hit = next((index for index, answer in enumerate(answers) if answer != EXISTS), len(records))
        hit = min(hit, (serving.tokens - 1) // BLOCK_TOKENS)
        if hit:
            got = self._store.batch_get_into_multi_buffers(
                [key for key, _, _ in records[:hit]],
                [ptrs for _, ptrs, _ in records[:hit]],
                [sizes for _, _, sizes in records[:hit]],
            )
            good = next((index for index, code in enumerate(got) if code < 0), hit)
            self.tally.hit_chunks += good
            self.tally.load_failed_chunks += hit - good
        # save: its position starts at token 0, so it asks about the whole prompt again
        present = self._store.batch_is_exist([key for key, _, _ in records])
        missing = [record for record, answer in zip(records, present, strict=True) if answer != EXISTS]
        if missing:
            codes = self._store.batch_put_from_multi_buffers(
                [key for key, _, _ in missing],
                [ptrs for _, ptrs, _ in missing],
                [sizes for _, _, sizes in missing],
                self._store.new_replicate_config(),
            )
            self.tally.objects_put += sum(1 for code in codes if code == 0)
            self.tally.puts_refused += sum(1 for code in codes if code < 0 and code != -705)


def _merge(into: dict[str, int], counts: dict[str, int]) -> None:
    for name, value in counts.items():
        into[name] = into.get(name, 0) + value
