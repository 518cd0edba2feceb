"""The connector's scheduler side: what a request can load, when it loads, and what each step saves.

It runs in vLLM's scheduler (the engine-core process) and asks the store only
``batch_is_exist``. What counts as a hit is the stages' rule
(:class:`~kvpipe.stages.LookupPlan`: every storable group, every
rank); this module decides *when* to ask and *what to do with the answer*:

- **one store call per scheduling step**: the first lookup of a step also asks
  for every request still waiting, and the step's later lookups are answered
  from that (a master round trip each would cost milliseconds on a busy host);
- **one load per shared prefix**: with async loads, a request whose prefix is
  being loaded by another request is told "ask again" (``None``) until that load
  has finished; by then the blocks are in vLLM's own prefix cache and it hits
  them locally. (vLLM's own connector loads a copy per request.) With sync loads
  the same holds by construction: a load ends before the step's forward;
- **async only when it spares someone**: an async load exists so that running
  requests need not wait for it, and costs its own request steps (the load goes
  out with one step, is reported finished after another, computes in the next).
  With ``load_sync_when_idle`` (the default), a load that no running request
  would wait for (nothing computed in the previous step: an idle engine, or a
  burst of arrivals) runs before this step's forward instead, and its request
  computes in this very step. Only for one KV-cache group: vLLM 0.32 takes a
  failed load of a hybrid model only from an async load;
- **a prefix being saved is waited for**: a request whose hit a chunk this
  engine is still saving would extend (it computed the prefix a moment ago and
  has lost it from its own cache since: a reset, an eviction, a preemption) is
  told "ask again" until every rank has reported the chunk, for at most
  ``lookup_wait_for_saves_s`` (:mod:`.saves_in_flight`);
- **a stale hit recomputes once**: when a load fails (the objects vanished
  between lookup and load: evicted, or a master restarted), the request's next
  lookup is a miss, and the chunks that failed are misses for every request for
  a while, so ``recompute`` can never turn into a lookup/load loop;
- **saves**: each step plans, per running request, the chunks completed by the
  end of the step, each chunk offered once; decode-phase chunks only with
  ``save_decode_cache``;
- **retention**: every request's prompt is counted as it arrives, and a chunk
  that ``retention_min_requests`` requests asked for is marked for a soft pin
  in its save (:mod:`kvpipe.stages.retention`);
- **handoffs** (prefill and decode on different engines, :mod:`.handoff`): a
  request a prefill engine computes for a decode engine is saved whole, its
  saves first in their step, and its end returns the transfer parameters; a
  decode engine's request carrying them is told "ask again" until the chunks
  they promise are visible, for at most ``remote_prefill_wait_s``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from kvpipe.connector.store.breaker import breaker_of
from kvpipe.connector.store.protocol import Store
from kvpipe.stages import (
    Integrity,
    LoadRequest,
    LookupPlan,
    LookupRequest,
    SaveRequest,
    chunks_to_save,
)
from kvpipe.stages.keys import deployment_key_pattern, key_chunk_hex, shared_pool_id
from kvpipe.stages.load_plan import load_slots, longest_load
from kvpipe.stages.retention import ReuseCounter
from kvpipe.stages.store import EXISTS

from .engine_cache import EngineCache
from .events import ChunkAnnouncer
from .handoff import Handoff, HandoffError, HandoffOutcome, remote_decode
from .messages import KVPipeKVEvents, KVPipeMetadata
from .metrics import (
    BREAKER_STATE,
    EVENTS_DROPPED,
    HANDOFFS_BY_OUTCOME,
    LOADS_FAILED,
    LOADS_PLANNED,
    LOADS_SPARED,
    LOADS_SYNC,
    LOOKUP_CALLS,
    LOOKUP_HIT_TOKENS,
    LOOKUPS_DEFERRED,
    LOOKUPS_MISSED_AFTER_FAILED_LOAD,
    LOOKUPS_WAITED_FOR_SAVES,
    SAVES_PLANNED,
)
from .saves_in_flight import SavesInFlight
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = structlog.get_logger("kvpipe.connector.vllm")

#: keys one lookup call asks at most when it takes the waiting requests along
#: (batch_is_exist: ~0.05 ms for 32 keys, ~0.5-1 ms for 2048)
LOOKUP_BATCH_KEYS = 4096
#: lookup plans kept per waiting request: its own ask and the look-ahead's differ by the
#: local hit, and the load room moves as loads are planned
MEMO_PLANS = 4
#: how long a chunk whose load failed is a miss for every request: long enough for
#: the requests waiting on that load to recompute instead of repeating it
FAILED_CHUNK_TTL_S = 10.0
#: how often a decode request waiting for a prefill engine's chunks asks the store: vLLM asks
#: again at every step, and an engine with nothing else to run steps in a tight loop
HANDOFF_POLL_S = 0.005


@dataclass(frozen=True)
class _Load:
    """A load planned at allocation, and whether it loads beside the steps (async) or before a forward."""

    request: LoadRequest
    is_async: bool


@dataclass
class _SaveProgress:
    """How far an allocated request's saves have gone."""

    saved_tokens: int | None = None  # None until it is first scheduled
    tail_saved: bool = False  # its prompt's partial tail was offered
    offered: int = 0  # the furthest token its saves offered a chunk up to: what a handoff promises


@dataclass
class _Request:
    """Everything the scheduler side holds for one request, from its arrival until it is forgotten.

    vLLM finishes a request (``request_finished``) before the output that reports on
    its last step, and an async load may outlive its request: so a request is
    forgotten only once it is finished and none of its loads is still out
    (:meth:`SchedulerSide._forget_if_done`, the one place that forgets one).
    """

    request: Request
    waiting: bool = False  # arrived, not allocated yet: the step's first lookup asks for it too
    finished: bool = False  # vLLM has finished it
    # what its lookups found, for its allocation
    local_hit: int = 0  # vLLM's own prefix-cache hit: vLLM does not pass it to update_state_after_alloc
    tail_ends: tuple[tuple[int, int], ...] = ()  # where the objects holding the hit's cut blocks end
    load_async: bool = False  # whether the last lookup's hit loads async
    deferred: bool = False  # told to wait for another request's load of its prefix
    miss_once: bool = False  # its load failed: its next lookup misses
    # its load: planned at allocation, then out with a step's metadata until reported
    planned: _Load | None = None
    async_load: LoadRequest | None = None  # out, until finished_recving reports it
    sync_load: LoadRequest | None = None  # out with the last step, until the output on that step
    progress: _SaveProgress | None = None  # its saves; None until it is allocated
    # prefill for another engine (do_remote_decode): saved whole, a handoff returned at its end;
    # how far from token 0 the store held its prompt when it was looked up (its save starts
    # there, not at its local hit)
    remote_decode: bool = False
    store_holds: int = 0
    # a decode engine's: what the prefill engine promised, until found or given up; when the
    # wait ends, whether it waited, when the store is asked next
    handoff: Handoff | None = None
    handoff_until: float = 0.0
    handoff_waited: bool = False
    handoff_next_poll: float = 0.0
    # while it waits: its lookup plans, by what else they depend on (SchedulerSide._plan)
    plans: dict[tuple[int, int, int, int | None], LookupPlan] = field(default_factory=dict)

    def loads_out(self) -> list[LoadRequest]:
        """Its loads that hold (or will hold) staging slots: planned, or out and not reported."""
        planned = [] if self.planned is None else [self.planned.request]
        return planned + [load for load in (self.async_load, self.sync_load) if load is not None]


class SchedulerSide:
    """Lookups, load planning and save planning for one engine (see the module docstring)."""

    def __init__(
        self,
        cache: EngineCache,
        settings: ConnectorSettings,
        store: Store,
        clock: Callable[[], float] = time.monotonic,
        announcer: ChunkAnnouncer | None = None,
        saves: bool = True,
    ) -> None:
        """``announcer``: publish KV events for what the workers store (vLLM's ``kv_events_config``).

        ``saves``: whether the engine stores what it computes (not a ``kv_consumer``,
        :meth:`~.settings.ConnectorSettings.saves_for`); lookups follow ``enable_lookup``.
        """
        self.cache = cache
        self._saves = saves
        self.settings = settings
        self.store = store
        self.stats: Counter[str] = Counter()
        self._clock = clock
        # per request id: in arrival order, a request moved last when a load of it is planned, so
        # that loads go out in the order they were planned
        self._requests: dict[str, _Request] = {}
        # the engine's last step, asked at every hit: requests it computed and not finished since
        self._running: set[str] = set()
        self._exists: dict[str, bool] = {}  # this scheduling step's lookup answers
        self._loading: dict[bytes, str] = {}  # async loads: the hash blocks being loaded, and who loads them
        self._failed_chunks: dict[str, float] = {}  # chunk hash (hex) -> until when it is a miss
        self._sync_when_idle = settings.load_sync_when_idle and len(cache.groups) == 1
        # the worker's staging slots, where loads land (None: they load in place)
        self._staging_slots = (
            settings.staging_slots(cache.store_block_sizes) if settings.load_via_staging else None
        )
        self._slots_loading: int | None = None  # of loads planned or out; None: to reckon (once a step)
        self.announcer = announcer
        self._saving = (
            SavesInFlight(cache.putting_ranks, settings.lookup_wait_for_saves_s, clock)
            if saves and settings.waits_for_saves
            else None
        )
        # requests per chunk: the chunks they keep asking for are saved soft-pinned
        self._reuse = ReuseCounter(settings.retention_min_requests) if settings.retention else None
        self._pool = shared_pool_id(cache.namespace(0))  # where a handoff's chunks are

    @property
    def loads_in_flight(self) -> int:
        """Async loads emitted and not reported finished yet."""
        return sum(1 for state in self._requests.values() if state.async_load is not None)

    def _state(self, request: Request) -> _Request:
        """The state of ``request``, new if it has none."""
        if (state := self._requests.get(request.request_id)) is None:
            state = self._requests[request.request_id] = _Request(request)
        return state

    def _finish(self, rid: str) -> None:
        """vLLM has finished ``rid``: it waits no more, and a sync load not out yet never goes.

        (Its request is not scheduled again.) An async load still goes out with the
        step and is waited for: its end releases the prefix it loads for others.
        """
        if (state := self._requests.get(rid)) is None:
            return
        state.finished, state.waiting = True, False
        if state.planned is not None and not state.planned.is_async:
            state.planned = None
        self._forget_if_done(state)

    def _forget_if_done(self, state: _Request) -> None:
        """The one place a request is forgotten: once vLLM has finished it and none of its loads is out."""
        if state.finished and state.planned is None and state.async_load is None and state.sync_load is None:
            del self._requests[state.request.request_id]

    # -- lookups -------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        state = self._state(request)
        state.waiting = True
        if self._reuse is not None:
            self._reuse.asked(request.block_hashes)
        if params := getattr(request, "kv_transfer_params", None):  # set by a disaggregating proxy
            self._handoff_arrived(state, params)

    def _handoff_arrived(self, state: _Request, params: dict[str, Any]) -> None:
        """A request of a prefill/decode split: this engine prefills it for another, or decodes it."""
        if remote_decode(params):
            state.remote_decode = self._saves  # an engine that stores nothing hands nothing over
            return
        if not self.settings.enable_lookup:
            return
        request = state.request
        try:
            handoff = Handoff.from_params(params)
            why = (
                None
                if handoff is None
                else handoff.mismatch(request.block_hashes, self.cache.hash_block_size, self._pool)
            )
        except HandoffError as exc:
            handoff, why = None, str(exc)
        if why is not None:
            self.stats[HANDOFFS_BY_OUTCOME[HandoffOutcome.REFUSED]] += 1
            log.warning(
                "a prefill engine's handoff refused: computing the prompt",
                request_id=request.request_id,
                why=why,
            )
            return
        if handoff is not None:
            state.handoff = handoff
            state.handoff_until = self._clock() + self.settings.remote_prefill_wait_s

    def _stored_prefix(self, state: _Request) -> int:
        """How far from token 0 the store holds ``state``'s prompt (asked with the step's lookups).

        A prefill for another engine is saved whole: the chunks it found in its own
        prefix cache too, unless the store still holds them (the engine stored them
        when it computed them, or loaded them): then they are not copied again.
        """
        plan = self._plan(state, 0, None)
        keys = plan.keys
        if any(key not in self._exists for key in keys):
            self._look_up(keys)
        return plan.hit({key: self._exists.get(key, False) for key in keys})

    def _awaits_handoff(self, state: _Request, plan: LookupPlan, hit: int) -> bool:
        """Whether ``state``'s request waits on for its prefill engine's chunks, ``hit`` found so far.

        It waits until the hit reaches what was promised (as far as this engine may
        load: its load room, its last-block rule) or its wait runs out; then the
        handoff is settled, counted, and the hit loads as any other.
        """
        assert state.handoff is not None
        promised = min(state.handoff.tokens, plan.hit(dict.fromkeys(plan.keys, True)))
        now = self._clock()
        if hit >= promised:
            outcome = HandoffOutcome.WAITED if state.handoff_waited else HandoffOutcome.FOUND
        elif now >= state.handoff_until:
            outcome = HandoffOutcome.EXPIRED
            log.warning(
                "a prefill engine's chunks did not all arrive in time: computing the rest",
                request_id=state.request.request_id,
                promised_tokens=promised,
                found_tokens=hit,
                waited_s=self.settings.remote_prefill_wait_s,
            )
        else:
            state.handoff_waited, state.handoff_next_poll = True, now + HANDOFF_POLL_S
            return True
        self.stats[HANDOFFS_BY_OUTCOME[outcome]] += 1
        state.handoff = None
        return False

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` the store can give, and whether they load asynchronously.

        ``(None, False)`` asks vLLM to ask again next step: the prefix is being
        loaded by another request, or saved by this engine. This call has no lasting effect on what is
        loaded (vLLM may still trim or drop the hit): that is decided in
        :meth:`update_state_after_alloc`.
        """
        if not self.settings.enable_lookup:
            return 0, False
        state = self._state(request)
        state.local_hit = num_computed_tokens
        if state.remote_decode and num_computed_tokens > state.store_holds:
            state.store_holds = self._stored_prefix(state)
        if state.miss_once:
            state.miss_once = False
            self.stats[LOOKUPS_MISSED_AFTER_FAILED_LOAD] += 1
            return 0, False
        if state.handoff is not None and self._clock() < state.handoff_next_poll:
            return None, False  # asked the store a moment ago
        plan = self._plan(state, num_computed_tokens, self._load_room())
        lookup, keys = plan.request, plan.keys
        if not keys:
            if state.handoff is not None:  # nothing this engine could load: nothing to wait for
                self._awaits_handoff(state, plan, num_computed_tokens)
            return 0, False
        if any(key not in self._exists for key in keys):
            self._look_up(keys)
        failed = self._failed_recently()
        # unanswered: a miss; a chunk whose load just failed: a miss too, whatever the master says
        exists = {key: self._exists.get(key, False) and key_chunk_hex(key) not in failed for key in keys}
        hit = plan.hit(exists)
        if state.handoff is not None and self._awaits_handoff(state, plan, hit):
            return None, False
        if self._saving is not None and self._landing_extends(plan, exists, hit):
            self.stats[LOOKUPS_WAITED_FOR_SAVES] += 1
            return None, False
        new = max(0, hit - num_computed_tokens)
        if new and self._loaded_by_another(lookup, hit):
            self.stats[LOOKUPS_DEFERRED] += 1
            state.deferred = True
            return None, False
        self.stats[LOOKUP_HIT_TOKENS] += new
        state.load_async = bool(new) and self._loads_async()
        # a hit inside a block loads that block from the object the lookup found in it
        state.tail_ends = plan.cut_block_sources(exists, hit) if new and self.cache.hit_alignment else ()
        return new, state.load_async

    def _landing_extends(self, plan: LookupPlan, exists: dict[str, bool], hit: int) -> bool:
        """Whether chunks this engine is saving, once landed, would give ``plan`` more than ``hit``."""
        assert self._saving is not None
        awaited = self._saving.awaited_among(plan.chunk_hexes)  # a plan's hexes are made once
        if not awaited:
            return False
        landing = dict.fromkeys(
            (key for key, found in exists.items() if not found and key_chunk_hex(key) in awaited), True
        )
        return bool(landing) and plan.hit(exists | landing) > hit

    def _load_room(self) -> int | None:
        """The tokens one more load may bring: what the staging slots hold less the loads planned or out.

        A load lands in the worker's staging slots, and one that finds too few free
        fails whole: a hit stops at the room instead, and the engine computes the
        rest. None: loads do not go through the slots (``load_via_staging`` off).
        Saves hold slots too, briefly: a load that meets them fails, counted by the worker.
        """
        if self._staging_slots is None:
            return None
        if self._slots_loading is None:  # walks every request: once a step, then kept up to date
            self._slots_loading = sum(
                self._slots_of(load) for state in self._requests.values() for load in state.loads_out()
            )
        return longest_load(self.cache.store_groups, max(0, self._staging_slots - self._slots_loading))

    def _slots_of(self, load: LoadRequest) -> int:
        return load_slots(self.cache.store_groups, load.start_tokens, load.end_tokens)

    @property
    def _sealed(self) -> bool:
        """Whether a hit needs every object's seal too (``integrity: required``)."""
        return self.settings.integrity is Integrity.REQUIRED

    def _plan(self, state: _Request, num_computed_tokens: int, max_load_tokens: int | None) -> LookupPlan:
        """The lookup plan of ``state``'s request, made once while it waits.

        vLLM asks about a waiting request at every step until it is allocated, and
        every step's first lookup asks for the requests waiting behind it too: one
        plan (its keys cost ~0.7 us a chunk to make) serves all of those asks. A
        plan depends on the request's hashes, which only grow (hence their count in
        the memo's key), its length, the engine's local hit and the load room.
        """
        request = state.request
        inputs = (len(request.block_hashes), request.num_tokens, num_computed_tokens, max_load_tokens)
        if (plan := state.plans.get(inputs)) is None:
            if len(state.plans) >= MEMO_PLANS:  # inputs moved on (a local hit, the room): the old ones are done
                state.plans.clear()
            lookup = LookupRequest(
                request.request_id,
                tuple(request.block_hashes),
                request.num_tokens,
                num_computed_tokens,
                max_load_tokens,
            )
            cache = self.cache
            plan = state.plans[inputs] = LookupPlan(
                cache.store_groups,
                cache.lookup_shards,
                cache.hash_block_size,
                lookup,
                cache.hit_alignment,
                self._sealed,
                cache.recomputes_last_block,
            )
        return plan

    def _loads_async(self) -> bool:
        """Whether a hit found now loads beside the steps (see "async only when it spares someone")."""
        if not self.settings.load_async:
            return False
        return bool(self._running) or not self._sync_when_idle

    def _hashes(self, lookup: LookupRequest | LoadRequest, start: int, end: int) -> Sequence[bytes]:
        hbs = self.cache.hash_block_size
        return lookup.block_hashes[start // hbs : end // hbs]

    def _failed_recently(self) -> set[str]:
        """The chunk hashes (hex, as keys end) whose load failed less than FAILED_CHUNK_TTL_S ago."""
        now = self._clock()
        for chunk, until in list(self._failed_chunks.items()):
            if until <= now:
                del self._failed_chunks[chunk]
        return set(self._failed_chunks)

    def _loaded_by_another(self, lookup: LookupRequest, hit: int) -> bool:
        start = lookup.num_computed_tokens
        return any(
            self._loading.get(hash_, lookup.request_id) != lookup.request_id
            for hash_ in self._hashes(lookup, start, hit)
        )

    def _look_up(self, keys: Sequence[str]) -> None:
        """One ``batch_is_exist`` for ``keys`` and those of the requests still waiting.

        vLLM asks request by request within one scheduling step. One call for all
        of them costs about what one costs (requests sharing a prefix share keys),
        where a call per request is a master round trip each, which a busy 2-core
        machine stretches to milliseconds. The answers hold for this step only.
        """
        wanted = dict.fromkeys(key for key in keys if key not in self._exists)
        for waiting in (state for state in self._requests.values() if state.waiting):
            if len(wanted) >= LOOKUP_BATCH_KEYS:
                break
            keys_ahead = self._plan(waiting, 0, self._load_room()).keys
            wanted.update(dict.fromkeys(key for key in keys_ahead if key not in self._exists))
        asked = list(wanted)
        self.stats[LOOKUP_CALLS] += 1
        try:
            answers = self.store.batch_is_exist(asked)
        except Exception as exc:  # noqa: BLE001 - a lookup that cannot answer is a miss
            log.warning("lookup failed", error=str(exc))
            return
        self._exists.update((key, answer == EXISTS) for key, answer in zip(asked, answers, strict=False))
        if self.announcer is not None:  # 0 is "absent"; a negative code knows nothing
            absent = (
                bytes.fromhex(key_chunk_hex(key))
                for key, code in zip(asked, answers, strict=False)
                if code == 0
            )
            self.announcer.found_absent(absent)

    # -- allocation and planning ---------------------------------------------------------

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        state = self._state(request)
        state.waiting = False
        state.plans.clear()  # allocated: it is not looked up again until it waits again
        state.progress = state.progress or _SaveProgress()
        local, load_async, deferred, tail_ends = state.local_hit, state.load_async, state.deferred, state.tail_ends
        state.local_hit, state.load_async, state.deferred, state.tail_ends = 0, False, False, ()  # taken
        if deferred and num_external_tokens == 0 and local > 0:
            self.stats[LOADS_SPARED] += 1  # another request's load put its prefix in the local cache
        if num_external_tokens > 0:
            block_ids = tuple(tuple(ids) for ids in blocks.get_block_ids())
            load = LoadRequest(
                rid, tuple(request.block_hashes), block_ids, local, local + num_external_tokens, tail_ends
            )
            if state.planned is None:  # last: loads go out in the order they were planned
                self._requests[rid] = self._requests.pop(rid)
            if self._slots_loading is not None:
                replaced = 0 if state.planned is None else self._slots_of(state.planned.request)
                self._slots_loading += self._slots_of(load) - replaced
            state.planned = _Load(load, load_async)
            if load_async:
                self._loading.update(
                    dict.fromkeys(self._hashes(load, load.start_tokens, load.end_tokens), rid)
                )
            else:
                self.stats[LOADS_SYNC] += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPipeMetadata:
        so = scheduler_output
        meta = KVPipeMetadata()
        self._exists.clear()  # the step is planned: the next one asks again
        self._slots_loading = None  # what went out is counted as out: reckoned again at the next lookup
        for rid in so.finished_req_ids:
            self._finish(rid)  # request_finished did it already, in vLLM
        for new in so.scheduled_new_reqs:
            progress = self._progress(new.req_id)
            if progress is not None and progress.saved_tokens is None:
                # local + loaded: never saved again, but a handoff is saved whole: from where
                # the store's copy of its prompt ended when it was looked up
                request_state = self._requests[new.req_id]
                computed = new.num_computed_tokens
                progress.saved_tokens = (
                    min(computed, request_state.store_holds) if request_state.remote_decode else computed
                )
        # An async load's request is not scheduled: its load goes out in this very step.
        # A sync load runs before the forward of the step that schedules its request.
        for rid, state in self._requests.items():
            planned = state.planned
            if planned is None or not (planned.is_async or rid in so.num_scheduled_tokens):
                continue
            state.planned = None
            meta.loads.append(planned.request)
            if planned.is_async:
                state.async_load = planned.request
            else:
                meta.sync_loads.add(rid)
                state.sync_load = planned.request
            self.stats[LOADS_PLANNED] += 1
        self._running = set(so.num_scheduled_tokens) - set(so.finished_req_ids)
        self._plan_saves(so, meta)
        return meta

    def _plan_saves(self, so: SchedulerOutput, meta: KVPipeMetadata) -> None:
        block_state = so.kv_connector_block_state
        if block_state is None or not self._saves:
            return
        for rid, scheduled in so.num_scheduled_tokens.items():
            progress = self._progress(rid)
            if progress is None:
                continue
            request_state = self._requests[rid]
            request = request_state.request
            saved = (
                progress.saved_tokens if progress.saved_tokens is not None else request.num_computed_tokens
            )
            state = request.num_computed_tokens + scheduled  # where the engine's state will stand
            done = state if self.settings.save_decode_cache else min(state, request.num_prompt_tokens)
            hashes = tuple(request.block_hashes)
            ends = [(done, False)]
            tail = self._tail_boundary(request)
            if tail is not None and not progress.tail_saved and done >= tail:
                progress.tail_saved = True  # offered once, on the first save that covers it
                ends = [(tail, True)] + (
                    [(done, False)] if self._reach(done, hashes) > self._reach(tail, hashes) else []
                )
            block_ids: tuple[tuple[int, ...], ...] | None = None
            for end, finished in ends:
                reach = self._reach(end, hashes)
                if reach <= saved and not finished:
                    continue
                if block_ids is None:
                    table = block_state.get_block_ids(rid)
                    assert table is not None, "vLLM offers the block table of every request it schedules"
                    block_ids = tuple(tuple(ids) for ids in table)
                reused = self._reused(hashes, saved, end)
                save = SaveRequest(
                    rid,
                    hashes,
                    block_ids,
                    end,
                    saved,
                    finished,
                    state_tokens=state,
                    reused_chunks=reused,
                    handoff=request_state.remote_decode,
                )
                meta.saves.append(save)
                progress.offered = max(progress.offered, end if finished else reach)
                if self._saving is not None or self.announcer is not None:  # both follow the save's chunks
                    chunks = chunks_to_save(save, self.cache.store_groups, self.cache.hash_block_size)
                    if self._saving is not None:
                        self._saving.planned(chunk.chunk_hash for chunk in chunks)
                    if self.announcer is not None:
                        self.announcer.expect(request, save, chunks)
                        self.stats[EVENTS_DROPPED] = self.announcer.given_up  # monotonic: reported as growth
                saved = max(saved, reach)
                self.stats[SAVES_PLANNED] += 1
            progress.saved_tokens = saved
        meta.saves.sort(key=lambda save: not save.handoff)  # a handoff's first: another engine waits for it

    def _progress(self, rid: str) -> _SaveProgress | None:
        """How far the saves of an allocated request have gone; None for a request not allocated."""
        state = self._requests.get(rid)
        return None if state is None else state.progress

    def _reused(self, hashes: Sequence[bytes], saved: int, end: int) -> dict[bytes, int]:
        """The chunks between ``saved`` and ``end`` that requests keep asking for, with their counts."""
        if self._reuse is None:
            return {}
        hbs = self.cache.hash_block_size
        return self._reuse.reused(hashes[saved // hbs : -(-end // hbs)])

    def _reach(self, tokens: int, hashes: Sequence[bytes]) -> int:
        """The end of the whole chunks of every stored group within ``tokens`` (and the hashes)."""
        hashed = len(hashes) * self.cache.hash_block_size
        return min(
            min(tokens, hashed) // g.spec.block_size * g.spec.block_size for g in self.cache.store_groups
        )

    def _tail_boundary(self, request: Request) -> int | None:
        """Where a prompt's partial tail ends, when the engine allows hits inside a block.

        The longest hashed prefix strictly below the prompt (a request with the
        same prompt must compute one token): vLLM's connector publishes the tail
        there, with a recurrent group's state, and vLLM's scheduler ends a
        prefill step there so that the state exists.
        """
        if self.cache.hit_alignment is None:
            return None
        hbs = self.cache.hash_block_size
        tail = (request.num_prompt_tokens - 1) // hbs * hbs
        return tail if any(tail % g.spec.block_size for g in self.cache.store_groups) else None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Loads that ended (well or not): async ones release their prefix; failed ones are remembered.

        And the workers' chunk reports: saves that ended, for the lookups waiting on them and for KV events.
        """
        failed_requests = set(connector_output.failed_recving or ())
        failed_blocks = set(connector_output.invalid_block_ids or ())
        self._slots_loading = None  # loads ended: their slots are free again
        if isinstance(reports := connector_output.kv_cache_events, KVPipeKVEvents):
            if self._saving is not None:
                self._saving.reported(reports.reports)
            if self.announcer is not None:
                self.announcer.reported(reports.reports)
        for rid in connector_output.finished_recving or ():
            state = self._requests.get(rid)
            if state is None or (load := state.async_load) is None:
                continue
            state.async_load = None
            for hash_ in self._hashes(load, load.start_tokens, load.end_tokens):
                if self._loading.get(hash_) == rid:
                    del self._loading[hash_]
            if rid in failed_requests or any(failed_blocks.intersection(ids) for ids in load.block_ids):
                self._load_failed(load, None if rid in failed_requests else failed_blocks)
                state.miss_once = True
            self._forget_if_done(state)
        # a sync load ran before the forward this output reports on
        for state in list(self._requests.values()):
            load, state.sync_load = state.sync_load, None
            if load is None:
                continue
            if any(failed_blocks.intersection(ids) for ids in load.block_ids):
                self._load_failed(load, failed_blocks)
                # vLLM recomputes from the first failed block: what it computes is saved again
                progress = state.progress
                if progress is not None and progress.saved_tokens is not None:
                    progress.saved_tokens = min(progress.saved_tokens, load.start_tokens)
            self._forget_if_done(state)

    def _load_failed(self, load: LoadRequest, failed_blocks: set[int] | None) -> None:
        """Count a failed load, announce its chunks gone, and take them for misses a while."""
        self.stats[LOADS_FAILED] += 1
        if self.announcer is not None:
            self.announcer.load_failed(load, failed_blocks)
        until = self._clock() + FAILED_CHUNK_TTL_S
        hashes = self._hashes(load, load.start_tokens, load.end_tokens)
        self._failed_chunks.update(dict.fromkeys((hash_.hex() for hash_ in hashes), until))

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; for a prefill done for another engine, the handoff's transfer parameters.

        The worker copies what it saves, so vLLM may free the blocks now.
        """
        rid = request.request_id
        self._running.discard(rid)
        state = self._requests.get(rid)
        params = None
        if state is not None and state.remote_decode:
            offered = 0 if state.progress is None else state.progress.offered
            params = Handoff.of(
                request.block_hashes, self.cache.hash_block_size, offered, self._pool
            ).params()
            self.stats[HANDOFFS_BY_OUTCOME[HandoffOutcome.OFFERED]] += 1
        self._finish(rid)
        return False, params

    # -- operations ----------------------------------------------------------------------

    def reset(self) -> bool:
        """Remove this deployment's objects (this model, this cache prefix, every rank) from the store.

        Never another deployment's: one ``remove_by_regex`` scoped by
        :func:`~kvpipe.stages.keys.deployment_key_pattern`, leased objects too (a
        reset must not leave the objects just read). Saves still in flight on the
        workers may store a few objects after it: vLLM pauses generation before a
        reset for that reason. False when the store could not do it (logged).
        """
        pattern = deployment_key_pattern(self.cache.namespace(0))
        removed = self.store.remove_by_regex(pattern, force=True)
        self._exists.clear()
        self._failed_chunks.clear()
        if self._saving is not None:
            self._saving.forget()
        if self.announcer is not None:
            self.announcer.forget()
        if removed < 0:
            log.warning("store reset failed", pattern=pattern, code=removed)
            return False
        log.info("store reset: this deployment's objects removed", pattern=pattern, removed=removed)
        return True

    def gauges(self) -> dict[str, float]:
        """The scheduler's own reading: its store's breaker."""
        breaker = breaker_of(self.store)
        return {} if breaker is None else {BREAKER_STATE: breaker.state.level}
