"""The connector's worker side: the engine's KV memory, the save and load pipelines, what finished.

It runs in each vLLM worker (one per rank). At start it turns the engine's KV
tensors into block layouts (:mod:`.kv_layout`) and registers their memory; per
step it runs the loads the scheduler planned and stages the saves:

- **saves**: at the end of a step (``wait_for_save``) the blocks to save are
  copied into staging slots (:mod:`.staging_area`), one buffer per object, in
  one batch, and a :class:`~kvpipe.stages.SaveRequest` over the slots goes to the
  save pipeline (``when_full="drop"``), which waits for a device's copy before it
  reads them. The step never waits on the store and vLLM may reuse
  the blocks at once; a save that finds no free slot is dropped and counted.
- **loads**: ``submit_loads`` (when vLLM binds the step's metadata, before the
  forward) submits them to the load pipeline. Async loads
  return at once and are reported by ``get_finished`` once their job has ended,
  so the load runs while the engine steps other requests; sync loads (the
  scheduler's choice, per load: ``KVPipeMetadata.sync_loads``) are waited for
  before the forward. Failed blocks go to vLLM as block ids
  (one KV-cache group) or as a failed request (several groups: vLLM cannot map
  block ids back then), and are recomputed under ``kv_load_failure_policy:
  recompute``. A load lands in staging slots (host memory, checked there) and is
  copied into the engine's blocks on the engine's thread, ordered before the next
  forward; one that finds saves holding the slots it needs waits for them (by its
  deadline: an async one starts at a later hook, a sync one before the forward).
  So a load can be given up: past its deadline its blocks fail (vLLM
  recomputes them) and its request waits no longer, while the store call that
  may still write its slots keeps them taken until it ends. A native call cannot
  be cancelled, and one to a store node cut off by the network was measured to
  hold a request 41.7 s. ``load_via_staging: false`` loads a CPU cache in place:
  one copy less, and no giving up.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import structlog
import torch

from kvpipe.connector.store.breaker import breaker_of
from kvpipe.connector.store.protocol import Store
from kvpipe.pipeline import Job, Outcome, SyncPipeline
from kvpipe.stages import (
    BlockLayout,
    KVCache,
    LoadRequest,
    ObjectStatus,
    SaveRequest,
    StoreObject,
    Verdict,
    chunks_to_save,
    default_load_graph,
    default_save_graph,
)
from kvpipe.stages.integrity import engine_facts
from kvpipe.stages.load import load_chunks, touched_block_ids
from kvpipe.stages.retention import LoadedKeys

from .device import Device
from .engine_cache import EngineCache
from .events import ChunkReporter
from .kv_layout import GroupLayout, group_layout, layer_facts, shard_layouts, storages_of
from .metrics import (
    BREAKER_STATE,
    CHUNKS_BY_VERDICT,
    CHUNKS_LOAD_FAILED,
    CHUNKS_LOADED,
    CHUNKS_LOADED_FROM_OTHERS,
    ENGINE_COPY_WAIT_SECONDS,
    LOADS,
    LOADS_FAILED_NO_STAGING,
    LOADS_GIVEN_UP,
    LOADS_WAITED_FOR_STAGING,
    OBJECTS_BY_STATUS,
    SAVE_JOBS_BY_OUTCOME,
    SAVE_LANDING_SECONDS,
    SAVES_DROPPED_NO_STAGING,
    SAVES_SUBMITTED,
    SEALS_FAILED,
    STAGE_DROPPED,
    STAGE_QUEUE_DEPTH,
    STAGING_SLOTS,
    STAGING_SLOTS_IN_USE,
    per_stage,
)
from .registrations import BufferRegistrations
from .settings import ConnectorSettings
from .staging_area import StagingArea

if TYPE_CHECKING:
    from kvpipe.stages import Chunk

    from .messages import ChunkReport, KVPipeMetadata

log = structlog.get_logger("kvpipe.connector.vllm")

#: the outer bound on waiting for a sync load; its job's deadline ends it long before
LOAD_TIMEOUT_S = 60.0
STOP_DEADLINE_S = 10.0
#: observations kept for :meth:`WorkerSide.take_samples` (a histogram's); vLLM takes them
#: every step, so the bound only matters where nobody does (the oldest go first)
SAMPLES_KEPT = 65536


def parallel_ranks() -> tuple[int, int, int]:
    """(tp_rank, pp_rank, pcp_rank) from vLLM's parallel state; 0 where it is not initialised."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp, pp = get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except Exception:  # noqa: BLE001 - no parallel state (a unit test, one rank)
        return 0, 0, 0
    try:
        from vllm.distributed.parallel_state import get_pcp_group

        return tp, pp, get_pcp_group().rank_in_group
    except Exception:  # noqa: BLE001 - no PCP group (not initialised, or a vLLM without PCP)
        return tp, pp, 0


#: how many chunks a worker remembers having put, to tell a load of another engine's
#: chunk (a fleet's cross-replica hit) from a load of its own; ~100 bytes each
PUT_HERE_REMEMBERED = 65536


class _Placement(NamedTuple):
    """Where one chunk of a save or a load lies in the engine: the block its last token falls in."""

    group: int  # engine KV-cache group
    table_index: int  # the chunk's index in the group's block table
    block: int  # engine block id (a tail's block is partly filled)


class _SlotCopy(NamedTuple):
    """One block to move between the engine and a staging slot (a :data:`.staging_area.Copy`)."""

    group: int  # engine KV-cache group
    slot: int
    block: int  # engine block id


@dataclass
class _Load:
    """A load: its job (None: not started), and the slots it lands in first (unless in place).

    A load that found the staging slots held by saves waits for them
    (``slots_wanted``, until ``waits_until``) before its job starts; one whose job
    never starts fails whole.
    """

    request: LoadRequest  # over engine block ids
    job: Job | None  # its item is the request over the slots it lands in
    bounce: list[_SlotCopy] = field(default_factory=list)
    via_slots: bool = False  # nothing it writes reaches the engine before it is settled
    slots_wanted: list[_Placement] | None = None  # waiting for free slots: where its chunks go
    waits_until: float = math.inf  # when a load waiting for slots fails instead

    @property
    def waiting(self) -> bool:
        """It waits for saves to give staging slots back; its job has not started."""
        return self.slots_wanted is not None

    @property
    def done(self) -> bool:
        return not self.waiting if self.job is None else self.job.done

    @property
    def over(self) -> bool:
        """Its job has ended, or it lands in slots and its deadline has passed (then it is given up)."""
        return self.done or (self.via_slots and self.job is not None and self.job.expired)

    def wait_s(self) -> float:
        """How long the engine may wait for it: to its deadline when it can be given up, else for its call."""
        if self.waiting:
            return min(LOAD_TIMEOUT_S, max(0.0, self.waits_until - time.monotonic()))
        if self.via_slots and self.job is not None and self.job.deadline < math.inf:
            return min(LOAD_TIMEOUT_S, max(0.0, self.job.deadline - time.monotonic()))
        return LOAD_TIMEOUT_S


class _StagedSave(NamedTuple):
    """A save whose chunks have slots: the copies that fill them, the request over them, its chunks."""

    copies: list[_SlotCopy]
    request: SaveRequest  # over staging slots
    chunks: list[Chunk]


@dataclass(frozen=True)
class _StartOptions:
    """How :meth:`WorkerSide.register_kv_caches` sets the worker up (see :class:`WorkerSide`)."""

    transfers: bool
    max_pinned_bytes: int
    staging_device: Device | None


class _LoadFailures:
    """What failed in the loads, from the load stage's report to vLLM's questions; thread-safe.

    The load stage tells a request's failed blocks on the load pipeline's thread;
    the worker settles them into what vLLM asks for: failed block ids (one KV-cache
    group) or failed requests (several: vLLM cannot map block ids back then).
    What the stage tells is kept per submitted request object, not per request id:
    a load given up may tell its outcome after its request was loaded again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # by the load stage: id(submitted request) -> (it, its failed blocks)
        self._told: dict[int, tuple[LoadRequest, frozenset[int]]] = {}
        self._blocks: set[int] = set()  # engine block ids, for get_block_ids_with_load_errors
        self._requests: set[str] = set()

    def told(self, request: LoadRequest, failed_block_ids: frozenset[int]) -> None:
        with self._lock:
            self._told[id(request)] = (request, failed_block_ids)

    def take_told(self, request: LoadRequest) -> frozenset[int] | None:
        """What the load stage told of the load of ``request`` (as submitted); None: nothing yet."""
        with self._lock:
            told = self._told.get(id(request))
            if told is None or told[0] is not request:
                return None
            del self._told[id(request)]
            return told[1]

    def record(self, request_id: str, blocks: set[int], as_request: bool) -> None:
        """A settled load's failed ``blocks``: for vLLM, its failed request (``as_request``) or block ids."""
        with self._lock:
            if as_request:
                self._requests.add(request_id)
            else:
                self._blocks.update(blocks)

    def take_requests(self) -> set[str]:
        with self._lock:
            failed, self._requests = self._requests, set()
        return failed

    def take_blocks(self) -> set[int]:
        with self._lock:
            errors, self._blocks = self._blocks, set()
        return errors


class WorkerSide:
    """One rank's saves and loads (see the module docstring)."""

    def __init__(
        self,
        cache: EngineCache,
        settings: ConnectorSettings,
        store: Store,
        tp_rank: int = 0,
        *,
        kv_events: bool = False,
        max_pinned_bytes: int = 0,
        transfers: bool = True,
        staging_device: Device | None = None,
    ) -> None:
        """``transfers``: False for a capacity-only engine (a ``kv_consumer`` that neither
        looks up nor saves): it lends the store its segment and touches no KV cache.

        ``kv_events``: report each saved chunk's outcome for the scheduler's KV events
        (:meth:`take_chunk_reports`); reported too where lookups wait for saves
        (``lookup_wait_for_saves_s``). ``max_pinned_bytes``: what the saves may hold
        soft-pinned (the chunks the scheduler marks as reused; 0: none).
        ``staging_device``: where the staging copies run (None: the cache's device; a test's double).
        """
        self.cache = cache
        self.settings = settings
        self.store = store
        self.tp_rank = tp_rank
        self.stats: Counter[str] = Counter()
        self.observed: deque[tuple[StoreObject, ObjectStatus]] = deque(maxlen=65536)
        #: per save landed, seconds from its step to stored (:data:`SAVE_LANDING_SECONDS`)
        self.landings: deque[float] = deque(maxlen=SAMPLES_KEPT)
        #: per step start that waited for the last step's staging copies, the seconds it waited
        self.engine_waits: deque[float] = deque(maxlen=SAMPLES_KEPT)
        self._put_here: OrderedDict[bytes, None] = OrderedDict()  # chunk hashes, newest last
        self._options = _StartOptions(transfers, max_pinned_bytes, staging_device)
        self._memory = BufferRegistrations(store)
        self.layouts: dict[int, tuple[GroupLayout, ...]] = {}  # per engine group, per store shard of the rank
        # set up by register_kv_caches
        self._staging: StagingArea | None = None
        self._load_via_staging = False
        self._save_pipeline: SyncPipeline | None = None
        self._load_pipeline: SyncPipeline | None = None
        self._job_slots: dict[int, list[int]] = {}  # save jobs in flight: their staging slots
        self._loads: dict[str, _Load] = {}  # async loads in flight
        self._sync_loads: list[_Load] = []  # this step's, submitted, waited for in start_load_kv
        self._given_up: list[_Load] = []  # settled past their deadlines, their calls still running
        self._waiting_loads: deque[_Load] = deque()  # for saves to give slots back, first come first served
        self._submitted: KVPipeMetadata | None = None  # the step whose loads went out
        self._load_failures = _LoadFailures()
        reports = kv_events or settings.waits_for_saves
        self.reporter = ChunkReporter((cache.writer(tp_rank), cache.pp_rank)) if reports else None

    @property
    def started(self) -> bool:
        return self._save_pipeline is not None

    # -- start-up ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> None:
        """Lay out the engine's blocks, register their memory, start the pipelines.

        Raises :class:`~.kv_layout.LayoutError` (naming the layer and the layout)
        for a cache whose blocks cannot be stored as equal-stride rows.
        """
        options = self._options
        if not options.transfers:
            log.info("capacity-only: the store gets this engine's segment, no KV cache is transferred")
            return
        cache = self.cache
        # Every storable group's objects are made of every storable layer's cache (the
        # groups overlay them), in the engine's order: what vLLM's connector stores.
        stored = {name for group in cache.store_groups for name in cache.layer_names[group.engine_group]}
        layers = {name: value for name, value in kv_caches.items() if name in stored}
        shards: tuple[GroupLayout, ...]
        if cache.store_format.sharded:
            block_size = cache.store_groups[0].spec.block_size  # sharded: one plain attention group
            shards = shard_layouts(
                layers, cache.num_blocks, block_size, cache.shards_per_rank, cache.layout_name
            )
        else:
            shards = (group_layout(layers, cache.num_blocks, cache.layout_name),)
        facts = layer_facts(layers, cache.shards_per_rank)
        byte_facts = (*cache.byte_facts, *engine_facts({"layers": facts}))
        self.layouts = {group.engine_group: shards for group in cache.store_groups}
        slots = self.settings.staging_slots(cache.store_block_sizes)
        staging = self._staging = StagingArea(self.layouts, slots, options.staging_device)
        on_cpu = staging.device.type == "cpu"
        self._load_via_staging = not on_cpu or self.settings.load_via_staging
        # The store meets only the (host) staging arena, unless loads land in place.
        self._memory.register({} if self._load_via_staging else storages_of(list(layers.values())), engine=True)
        self._memory.register({staging.arena.data_ptr(): staging.arena.numel()})
        engine = [
            {g: layouts[shard].block_layout for g, layouts in self.layouts.items()}
            for shard in range(len(shards))
        ]
        load_kv = self._rank_cache(staging.layouts() if self._load_via_staging else engine, byte_facts)
        # each load of a pinned chunk is one more request for it: the save's pin budget hears of it
        loaded_keys = LoadedKeys() if options.max_pinned_bytes else None
        self._save_pipeline = SyncPipeline(
            default_save_graph(
                self._rank_cache(staging.layouts(), byte_facts),
                self.store,
                enable_group_semantics=self.settings.enable_group_semantics,
                max_buffers_per_call=self.settings.max_buffers_per_call,
                observer=self._observe,
                integrity=self.settings.integrity,
                max_pinned_bytes=options.max_pinned_bytes,
                soft_pin_ttl_s=self.settings.retention_pin_ttl_s,
                loaded_keys=loaded_keys,
            ),
            queue_capacity=self.settings.queue_capacity,
            when_full="drop",
            name="kvpipe-save",
            job_deadline_s=self.settings.save_deadline_s,
            nice=self.settings.save_nice,
        ).start()
        self._load_pipeline = SyncPipeline(
            default_load_graph(
                load_kv,
                self.store,
                load_observer=self._load_failures.told,
                max_buffers_per_call=self.settings.max_buffers_per_call,
                integrity=self.settings.integrity,
                loaded_keys=loaded_keys,
            ),
            queue_capacity=self.settings.queue_capacity,
            when_full="wait",
            name="kvpipe-load",
            job_deadline_s=self.settings.load_deadline_s,
            nice=self.settings.load_nice,
        ).start()

    # -- sleep mode (vLLM 0.33) -----------------------------------------------------------

    def release_kv_caches(self) -> None:
        """Let go of the KV caches before vLLM's sleep mode frees them; idempotent.

        vLLM sleeps an idle engine, but a load of a request it gave up on may still be
        running: it is waited for (its job's deadline bounds the wait), so nothing writes
        into memory being freed, and the engine's storages are unregistered from the
        store. Saves read only the staging arena, which is host memory sleep keeps.
        """
        if self._memory.released:
            return
        while self._waiting_loads:  # one that started now would be copied into memory being freed
            self._fail_waiting(self._waiting_loads.popleft())
        for load in [*self._loads.values(), *self._sync_loads]:
            if load.job is not None and not load.job.wait(LOAD_TIMEOUT_S):
                log.warning("a load outlived its wait before sleep", request_id=load.request.request_id)
        self.before_step()  # no save copy may still read the blocks
        self._memory.release_engine()

    def restore_kv_caches(self) -> None:
        """Take the KV caches back after vLLM's wake-up (the same addresses); idempotent."""
        if self._memory.released:
            self._memory.restore_engine()

    def _rank_cache(
        self, layouts: Sequence[Mapping[int, BlockLayout]], byte_facts: tuple[tuple[str, str], ...]
    ) -> KVCache:
        """This rank's cache over ``layouts`` (per store shard: the engine's blocks or the staging slots).

        ``byte_facts``: the cache's and its layers', which the objects' seals cover.
        """
        kv = self.cache.rank_cache(self.tp_rank, layouts)
        return replace(kv, byte_facts=byte_facts)

    # -- saves ---------------------------------------------------------------------------

    def _observe(self, record: StoreObject, status: ObjectStatus) -> None:
        self.observed.append((record, status))
        self.stats[OBJECTS_BY_STATUS[status]] += 1
        if status is ObjectStatus.PUT:
            self._put_here[record.chunk_hash] = None
            if len(self._put_here) > PUT_HERE_REMEMBERED:
                self._put_here.popitem(last=False)
        if self.reporter is not None:
            self.reporter.observed(record, status)

    def wait_for_save(self, meta: KVPipeMetadata) -> None:
        """Copy this step's saves into staging slots, then hand them to the save pipeline."""
        self._reap()
        if self._waiting_loads:  # slots the saves gave back go to the loads waiting for them first
            self._start_waiting_loads()
        if self._save_pipeline is None or self._staging is None or not meta.saves:
            return
        if not self.cache.puts_from(self.tp_rank):
            return  # a replica's bytes: the first rank of its replicas puts them
        staged = [staged for save in meta.saves if (staged := self._stage(save)) is not None]
        if not staged:
            return
        # One batch for the step's every block; on a device it is still under way, and
        # the save pipeline (never this thread) waits for it before a put reads a slot.
        fence = self._staging.copy_in([copy for staged_save in staged for copy in staged_save.copies])
        ready = None if fence.done() else fence.wait
        for staged_save in staged:
            request = staged_save.request
            job = self._save_pipeline.submit(request, ready=ready)
            self.stats[SAVES_SUBMITTED] += 1
            self._job_slots[job.id] = [copy.slot for copy in staged_save.copies]
            if self.reporter is not None:
                self.reporter.planned(job.id, request.request_id, staged_save.chunks)
        self._reap()

    def _stage(self, save: SaveRequest) -> _StagedSave | None:
        """Free slots for the save's chunks: the copies that fill them, the request over them, its chunks.

        None: nothing to save, or no room. The free slots that loads waiting for slots
        want are no room: a load is on its request's way to its first token, and saves
        taking each slot given back would keep it waiting until its deadline, and then
        the engine would compute the whole prefix again; a save dropped costs a later reuse.
        """
        assert self._staging is not None
        chunks = chunks_to_save(save, self.cache.store_groups, self.cache.hash_block_size)
        plan = [_Placement(c.group.engine_group, c.block_index, c.block_id) for c in chunks]
        if not plan:
            return None
        if len(plan) > self._staging.free - self._slots_wanted_by_loads():
            self.stats[SAVES_DROPPED_NO_STAGING] += 1
            if self.reporter is not None:
                self.reporter.dropped(chunks)
            return None
        copies, ids = self._into_slots(plan, save.block_ids)
        return _StagedSave(copies, replace(save, block_ids=ids), chunks)

    def _into_slots(
        self, plan: Sequence[_Placement], block_ids: tuple[tuple[int, ...], ...]
    ) -> tuple[list[_SlotCopy], tuple[tuple[int, ...], ...]]:
        """Free slots for ``plan``'s chunks: their copies to or from the engine, and ``block_ids`` naming them."""
        assert self._staging is not None
        slots = self._staging.take(len(plan))
        copies = [_SlotCopy(chunk.group, slot, chunk.block) for chunk, slot in zip(plan, slots, strict=True)]
        return copies, _remapped(block_ids, plan, slots)

    def _reap(self) -> None:
        """Free the staging slots of completed save jobs (counting their outcomes) and of given-up loads'."""
        if self._save_pipeline is not None:
            for job in self._save_pipeline.completed():
                self._reaped(job)
        if self._given_up:
            running: list[_Load] = []
            for load in self._given_up:
                if not load.done:
                    running.append(load)
                    continue
                assert self._staging is not None and load.job is not None  # a given-up load had both
                self._load_failures.take_told(load.job.item)  # too late to matter
                self._staging.give_back([copy.slot for copy in load.bounce])
            self._given_up = running

    def _reaped(self, job: Job) -> None:
        """A completed save job: free its staging slots, count its outcome."""
        assert self._staging is not None  # a save job's pipeline starts after the staging area
        self._staging.give_back(self._job_slots.pop(job.id, ()))
        self.stats[SEALS_FAILED] += job.counts.get("unsealed", 0)
        assert job.outcome is not None  # a completed job has its outcome
        self.stats[SAVE_JOBS_BY_OUTCOME[job.outcome]] += 1
        if job.outcome is Outcome.OK and job.elapsed_s is not None:
            # from the step that computed it to stored: when another replica can hit it
            self.landings.append(job.elapsed_s)
        if self.reporter is not None:
            self.reporter.ended(job.id)

    def before_step(self) -> None:
        """At a step's start, before anything may overwrite a block: the last step's save copies are done.

        On CPU a step's save copies run on the staging area's copy thread while the
        engine thread goes on; a block they read may be handed to another request
        by the next schedule and written by that step (a load, the forward), so the
        engine thread waits here for them, if they are not done already. vLLM calls
        ``handle_preemptions`` at a step's start for this; the connector asks again
        when the step's metadata is bound, for a vLLM that does not.
        """
        if self._staging is not None and (waited := self._staging.before_engine()):
            self.engine_waits.append(waited)

    # -- loads ---------------------------------------------------------------------------

    def submit_loads(self, meta: KVPipeMetadata) -> None:
        """Start this step's loads now, once per step (vLLM binds the step's metadata before its forward).

        vLLM calls ``start_load_kv`` before the forward only when the step has a
        sync load, and after it otherwise. On a CPU engine, whose forward returns
        when it is done, an async load would then start a whole forward late and
        its request compute a step later: so loads start here, when the metadata
        is bound, and ``start_load_kv`` waits for the sync ones.
        """
        if self._load_pipeline is None or not meta.loads or meta is self._submitted:
            return
        self._submitted = meta
        for load in meta.loads:
            submitted = self._submit_load(load)
            if load.request_id in meta.sync_loads:
                self._sync_loads.append(submitted)
            else:
                self._loads[load.request_id] = submitted

    def start_load_kv(self, meta: KVPipeMetadata) -> None:
        """Submit this step's loads unless :meth:`submit_loads` did; wait for the sync ones (before the forward)."""
        self.submit_loads(meta)
        waited, self._sync_loads = self._sync_loads, []
        if self._load_pipeline is None:
            return
        for load in waited:
            self._wait_for_slots(load)
            if load.job is not None and not load.job.wait(load.wait_s()):
                what = "load given up at its deadline" if load.via_slots else "load timed out"
                log.warning(what, request_id=load.request.request_id)
        self._settle_loads(waited, reported=False)
        if waited:
            self._load_pipeline.completed()  # their completions: nothing waits for them now

    def _submit_load(self, load: LoadRequest) -> _Load:
        """Submit one load (into staging slots first, unless in place).

        The scheduler plans no more loads than the slots hold, but saves hold slots
        too, for the few milliseconds of their puts: a load that finds too few free
        waits for the saves in flight to give theirs back (its job starts at a later
        hook, in arrival order, by its deadline); one that they could not make room
        for fails whole at once.
        """
        assert self._load_pipeline is not None and self._staging is not None
        self.stats[LOADS] += 1
        if not self._load_via_staging:
            return _Load(load, self._load_pipeline.submit(load))
        plan = self._load_plan(load)
        submitted = _Load(load, None, slots_wanted=plan)
        if not plan or (not self._waiting_loads and len(plan) <= self._staging.free):
            self._start(submitted)  # a load of nothing (or one the stage refuses) takes no slot: no line
        elif len(plan) <= self._staging.free + self._slots_held_by_saves():
            submitted.waits_until = time.monotonic() + self.settings.load_deadline_s
            self._waiting_loads.append(submitted)
            self.stats[LOADS_WAITED_FOR_STAGING] += 1
        else:
            self._fail_waiting(submitted)
        return submitted

    def _start(self, load: _Load) -> None:
        """Start a load's job into free slots (it has waited for them, or found them free)."""
        assert self._load_pipeline is not None and load.slots_wanted is not None
        copies, ids = self._into_slots(load.slots_wanted, load.request.block_ids)
        load.job = self._load_pipeline.submit(replace(load.request, block_ids=ids))
        load.bounce, load.via_slots, load.slots_wanted = copies, True, None

    def _fail_waiting(self, load: _Load) -> None:
        """A load that never starts: it fails whole (its request's blocks are recomputed)."""
        load.slots_wanted = None
        self.stats[LOADS_FAILED_NO_STAGING] += 1

    def _slots_wanted_by_loads(self) -> int:
        return sum(len(load.slots_wanted or ()) for load in self._waiting_loads)

    def _slots_held_by_saves(self) -> int:
        return sum(len(slots) for slots in self._job_slots.values())

    def _start_waiting_loads(self) -> None:
        """Start the loads waiting for slots that the saves have given back, in order; fail the expired."""
        assert self._staging is not None
        now = time.monotonic()
        while self._waiting_loads:
            load = self._waiting_loads[0]
            assert load.slots_wanted is not None
            if len(load.slots_wanted) <= self._staging.free:
                self._start(self._waiting_loads.popleft())
            elif now >= load.waits_until or len(load.slots_wanted) > self._staging.free + self._slots_held_by_saves():
                self._fail_waiting(self._waiting_loads.popleft())
            else:
                return

    def _wait_for_slots(self, load: _Load) -> None:
        """Before the forward: until a sync load waiting for slots has them, or its deadline has passed."""
        while load.waiting:
            left = load.waits_until - time.monotonic()
            pipeline = self._save_pipeline
            job = pipeline.next_completed(left) if pipeline is not None and left > 0 else None
            if job is not None:
                self._reaped(job)
            self._start_waiting_loads()
            if job is None and load.waiting:  # no save ended by its deadline
                self._waiting_loads.remove(load)
                self._fail_waiting(load)

    def _load_plan(self, load: LoadRequest) -> list[_Placement]:
        """Where every chunk the load fills lies in the engine (none if the load is invalid)."""
        try:
            chunks = load_chunks(self.cache.store_groups, self.cache.hash_block_size, load)
        except ValueError:
            return []  # the load stage refuses it with the reason; its blocks fail
        return [_Placement(chunk.group.engine_group, chunk.block_index, chunk.block_id) for chunk in chunks]

    def _settle_loads(self, loads: Sequence[_Load], reported: bool) -> None:
        """Loads whose jobs have ended (or timed out): settle each, then copy their bounced blocks home.

        One batch for them all, ordered before the engine's next forward without
        waiting for it here; their slots are reused once it is done.
        """
        home: list[_SlotCopy] = []
        slots: list[int] = []
        for load in loads:
            given_up = not load.done  # read once: its job may end on the pipeline's thread meanwhile
            failed = self._settle_load(load, reported, given_up)
            if given_up:
                self._given_up.append(load)  # its call may still write its slots: they stay taken
            elif load.bounce:
                home.extend(copy for copy in load.bounce if copy.block not in failed)
                slots.extend(copy.slot for copy in load.bounce)
        if slots:
            assert self._staging is not None
            if home:
                self._staging.copy_out(home)
            self._staging.give_back(slots)

    def _settle_load(self, load: _Load, reported: bool, given_up: bool) -> set[int]:
        """A load whose job has ended: count it, record what failed; the engine blocks that failed.

        ``reported``: an async load, whose end ``get_finished`` reports (a sync one's is not).
        """
        job, rid = load.job, load.request.request_id
        told = None if job is None or given_up else self._load_failures.take_told(job.item)
        if given_up:
            self.stats[LOADS_GIVEN_UP] += 1
        if told is None:
            # never started, given up, or refused before the stage: every block of its range
            # (not the blocks below it: those are the engine's own, maybe shared with others)
            failed = set(touched_block_ids(self.cache.store_groups, load.request))
        else:
            by_slot = {copy.slot: copy.block for copy in load.bounce}
            failed = {by_slot.get(block, block) for block in told}
        if job is not None:
            self.stats[CHUNKS_LOADED] += job.counts.get("loaded", 0)
            self.stats[CHUNKS_LOAD_FAILED] += job.counts.get("failed", 0)
            for verdict in Verdict:
                if count := job.counts.get(f"integrity_{verdict.value}", 0):
                    self.stats[CHUNKS_BY_VERDICT[verdict]] += count
        if not failed:
            self.stats[CHUNKS_LOADED_FROM_OTHERS] += self._stored_elsewhere(load.request)
            return failed
        # vLLM cannot map block ids of several groups back
        self._load_failures.record(rid, failed, as_request=len(self.cache.groups) > 1 and reported)
        return failed

    def _stored_elsewhere(self, load: LoadRequest) -> int:
        """The chunks of a whole load this worker did not put (of the last it remembers)."""
        try:
            chunks = load_chunks(self.cache.store_groups, self.cache.hash_block_size, load)
        except ValueError:
            return 0
        return sum(1 for chunk in chunks if chunk.chunk_hash not in self._put_here)

    def get_finished(self) -> set[str]:
        """Async loads whose jobs have ended since the last call, each reported once."""
        self._reap()
        if self._load_pipeline is None or not self._loads:
            return set()
        self._start_waiting_loads()
        self._load_pipeline.completed()
        finished = {rid for rid, load in self._loads.items() if load.over}
        self._settle_loads([self._loads.pop(rid) for rid in finished], reported=True)
        return finished

    def take_failed_requests(self) -> set[str]:
        return self._load_failures.take_requests()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._load_failures.take_blocks()

    # -- telemetry -----------------------------------------------------------------------

    def take_chunk_reports(self) -> list[ChunkReport]:
        """Chunks whose saves ended since the last call, stored whole or not (empty when nobody wants them)."""
        self._reap()
        return [] if self.reporter is None else self.reporter.take()

    def take_samples(self) -> dict[str, list[float]]:
        """The histograms' observations since the last call, per stats key (none: left out).

        :data:`SAVE_LANDING_SECONDS`: per save landed, the seconds from the step that
        computed it to stored; :data:`ENGINE_COPY_WAIT_SECONDS`: per step start that
        waited for the last step's staging copies, the seconds it waited.
        """
        self._reap()
        samples = {}
        for name, kept in ((SAVE_LANDING_SECONDS, self.landings), (ENGINE_COPY_WAIT_SECONDS, self.engine_waits)):
            if kept:
                samples[name] = list(kept)
                kept.clear()
        return samples

    def gauges(self) -> dict[str, float]:
        """What this rank holds now: staging slots, the breaker, each stage's queue.

        The stages are read on this thread, never waiting for a pipeline's loop (nicer
        than the engine, it would stall the step); the connector asks about once a
        second. The stages' drops found on the way go into :attr:`stats` as they
        stand (they only grow: the connector reports growth).
        """
        readings: dict[str, float] = {}
        if self._staging is not None:
            readings[STAGING_SLOTS] = self._staging.slots
            readings[STAGING_SLOTS_IN_USE] = self._staging.slots - self._staging.free
        if (breaker := breaker_of(self.store)) is not None:
            readings[BREAKER_STATE] = breaker.state.level
        for name, pipeline in (("save", self._save_pipeline), ("load", self._load_pipeline)):
            if pipeline is None:
                continue
            if pipeline.dropped:
                self.stats[per_stage(STAGE_DROPPED, name, "entry")] = pipeline.dropped
            for stage, snapshot in pipeline.metrics().items():
                readings[per_stage(STAGE_QUEUE_DEPTH, name, stage)] = snapshot.queue_depth
                if snapshot.dropped:
                    self.stats[per_stage(STAGE_DROPPED, name, stage)] = snapshot.dropped
        return readings

    # -- the end -------------------------------------------------------------------------

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every submitted save has completed (for tests and shutdown).

        It waits on the save pipeline's completions, each reaped as it comes.
        """
        deadline = time.monotonic() + timeout_s
        self._reap()
        while self._job_slots and self._save_pipeline is not None:
            job = self._save_pipeline.next_completed(max(0.0, deadline - time.monotonic()))
            if job is None:
                break
            self._reaped(job)
        return not self._job_slots

    def shutdown(self, owns_store: bool) -> None:
        for pipeline in (self._save_pipeline, self._load_pipeline):
            if pipeline is not None:
                try:
                    pipeline.stop(STOP_DEADLINE_S)
                except Exception as exc:  # noqa: BLE001 - shutdown goes on: the other pipeline, the store
                    log.warning("pipeline stop failed", error=str(exc))
        self._reap()
        self._save_pipeline = self._load_pipeline = None
        if self._staging is not None:
            self._staging.close()
        self._memory.unregister()
        if owns_store:
            self.store.close()


def _remapped(
    block_ids: tuple[tuple[int, ...], ...], plan: Sequence[_Placement], slots: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """``block_ids`` with each chunk of ``plan`` at its slot instead of its engine block.

    The stages read chunk ``i`` of a group from ``block_ids[g][i]``; a request
    over staging slots keeps the engine's shape with slot numbers where the
    chunks it carries are (other entries are never read).
    """
    ids = [list(group_ids) for group_ids in block_ids]
    for chunk, slot in zip(plan, slots, strict=True):
        table, index = ids[chunk.group], chunk.table_index
        if len(table) <= index:
            table.extend([slot] * (index + 1 - len(table)))
        table[index] = slot
    return tuple(tuple(group_ids) for group_ids in ids)
