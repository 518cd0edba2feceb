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
- **loads**: a :class:`~.loads.Loads` (:mod:`.loads`), started with the save
  pipeline, runs them (``submit_loads``, ``start_load_kv``, ``get_finished``) and
  tells vLLM what failed. It shares the staging slots with the saves: it asks the
  worker how many the saves hold and waits for saves to give theirs back, and a
  save takes none of the free slots that loads wait for.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import structlog
import torch

from kvpipe.connector.store.breaker import breaker_of
from kvpipe.connector.store.protocol import Store
from kvpipe.pipeline import Job, Outcome, SyncPipeline
from kvpipe.stages import (
    BlockLayout,
    GroupKind,
    KVCache,
    ObjectStatus,
    SaveRequest,
    StoreObject,
    chunks_to_save,
    default_save_graph,
)
from kvpipe.stages.integrity import engine_facts
from kvpipe.stages.model import Wave
from kvpipe.stages.retention import LoadedKeys

from .device import DONE, Device
from .engine_cache import EngineCache
from .events import ChunkReporter
from .kv_layout import GroupLayout, group_layout, layer_facts, layer_waves, shard_layouts, storages_of
from .layer_saves import SaveLayers, StepLayers
from .loads import LayerWait, Loads
from .metrics import (
    BREAKER_STATE,
    ENGINE_COPY_WAIT_SECONDS,
    FAILED_BY_JOB_COUNT,
    OBJECTS_BY_STATUS,
    SAVE_JOBS_BY_OUTCOME,
    SAVE_LANDING_SECONDS,
    SAVES_DROPPED_FAILED_LOAD,
    SAVES_DROPPED_NO_STAGING,
    SAVES_LAYERED,
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
from .staging_area import Placement, SlotCopy, StagingArea, into_slots

if TYPE_CHECKING:
    from kvpipe.stages import Chunk

    from .messages import ChunkReport, KVPipeMetadata

log = structlog.get_logger("kvpipe.connector.vllm")

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


class _StagedSave(NamedTuple):
    """A save whose chunks have slots: the copies that fill them, the request over them, its chunks."""

    copies: list[SlotCopy]
    request: SaveRequest  # over staging slots
    chunks: list[Chunk]
    job_id: int = -1  # once submitted


@dataclass(frozen=True)
class _StartOptions:
    """How :meth:`WorkerSide.register_kv_caches` sets the worker up (see :class:`WorkerSide`)."""

    transfers: bool
    max_pinned_bytes: int
    staging_device: Device | None


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
        self._loads: Loads | None = None
        self._job_slots: dict[int, list[int]] = {}  # save jobs in flight: their staging slots
        # layer-wise saves (save_layerwise): each layer's waves, which wave a layer completes,
        # and the step whose saves go out layer by layer, with their copies and views
        self._save_waves: tuple[Wave, ...] = ()
        self._save_wave_of: dict[str, int] = {}
        self._layered_step: tuple[KVPipeMetadata, StepLayers, list[tuple[_StagedSave, SaveLayers]]] | None = None
        self._forward_ended: dict[int, float] = {}  # layer-wise save jobs: when their step's forward ended
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
        # each load of a pinned chunk is one more request for it: the save's pin budget hears of it
        loaded_keys = LoadedKeys() if options.max_pinned_bytes else None
        order = list(layers)
        if self.settings.save_layerwise and len({layer_waves(s, order, completed=True) for s in shards}) == 1:
            self._save_waves = layer_waves(shards[0], order, completed=True)
            self._save_wave_of = {name: wave for wave, name in enumerate(order)}
        forward_order = self._layerwise_order(shards, order)
        # layer-wise here: the waves a load reads, which each seal's layer seal checks (stages/layer_seals.py)
        waves = layer_waves(shards[0], order) if forward_order or self._save_waves else ()
        by_group = {group: waves for group in self.layouts} if waves else {}
        save_cache = replace(self._rank_cache(staging.layouts(), byte_facts), layer_waves=by_group)
        loads_cache = self._rank_cache(staging.layouts() if self._load_via_staging else engine, byte_facts)
        if forward_order:
            loads_cache = replace(loads_cache, layer_waves=by_group)
        self._save_pipeline = SyncPipeline(
            default_save_graph(
                save_cache,
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
        self._loads = Loads(
            cache,
            self.settings,
            staging,
            loads_cache,
            self.store,
            via_staging=self._load_via_staging,
            loaded_keys=loaded_keys,
            stats=self.stats,
            put_here=self._put_here,
            slots_held_by_saves=self._slots_held_by_saves,
            reap_next_save=self._reap_next_save,
            layers=forward_order,
        )

    def _layerwise_order(self, shards: Sequence[GroupLayout], layers: list[str]) -> list[str]:
        """The layers in the order the forward runs them, if loads go layer by layer; else none.

        Only attention layers are waited for one by one (vLLM wraps their attention
        in the connector's hooks), and only a load in its request's step can go
        layer by layer: a model with several KV-cache groups loads asynchronously
        (vLLM 0.32 takes a failed load of such a model only from an async load), and
        one with mamba layers has layers no hook waits for: both load whole. Store
        shards of one rank must split their objects alike.
        """
        if not self.settings.load_layerwise:
            return []
        if len(self.cache.groups) > 1 or any(group.kind is GroupKind.MAMBA for group in self.cache.groups):
            log.info("load_layerwise: a model with several KV-cache groups or mamba layers loads whole objects")
            return []
        if len({layer_waves(shard, layers) for shard in shards}) != 1:
            log.info("load_layerwise: the rank's store shards split their objects differently; loads go whole")
            return []
        return layers

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
        if self._loads is not None:
            self._loads.before_sleep()
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

    def start_layered_saves(self, meta: KVPipeMetadata) -> None:
        """Before the step's forward (``save_layerwise``): take its saves' slots and submit them, once per step.

        Their objects are reserved while the forward runs; :meth:`save_kv_layer`
        copies each layer into the slots as it is computed, and :meth:`wait_for_save`
        gives the step's verdict (:mod:`.layer_saves`).
        """
        if not self._save_waves or self._save_pipeline is None or self._staging is None or not meta.saves:
            return
        if (self._layered_step is not None and self._layered_step[0] is meta) or not self.cache.puts_from(self.tp_rank):
            return
        self._reap()  # the slots the last step's saves gave back
        step = StepLayers(self._save_waves)
        saves: list[tuple[_StagedSave, SaveLayers]] = []
        for save in meta.saves:
            layers = SaveLayers(step)
            if (staged := self._stage(replace(save, layers=layers))) is not None:
                saves.append((staged._replace(job_id=self._submit(staged, ready=None)), layers))
        self.stats[SAVES_LAYERED] += len(saves)
        self._layered_step = (meta, step, saves)

    def save_kv_layer(self, layer: str) -> None:
        """After ``layer``'s attention: its bytes of the step's layer-wise saves go into their slots (copy started)."""
        if self._layered_step is not None and (wave := self._save_wave_of.get(layer)) is not None:
            self._copy_waves(self._layered_step[1], self._layered_step[2], wave + 1)

    def _copy_waves(self, step: StepLayers, saves: list[tuple[_StagedSave, SaveLayers]], upto: int) -> None:
        """Start copying the waves ``step`` has not copied yet, below ``upto``, and tell it of each."""
        assert self._staging is not None  # layer-wise saves start with the staging area
        copies = [copy for staged, _ in saves for copy in staged.copies]
        for wave in range(step.copied, upto):
            step.landed(self._staging.copy_in(copies, step.waves[wave]) if step.waves[wave] else DONE)

    def wait_for_save(self, meta: KVPipeMetadata) -> None:
        """Settle the step's layer-wise loads, copy its saves into staging slots, hand them to the save pipeline.

        A request whose load failed in this step computed over blocks vLLM now
        recomputes: its saves of the step go (what they hold may derive from bad
        bytes); a layer-wise one is called off (its objects revoked unseen).
        """
        failed_loads = self._loads.after_forward() if self._loads is not None else set()
        self._end_layered_saves(failed_loads)
        self._reap()
        if self._loads is not None:  # slots the saves gave back go to the loads waiting for them first
            self._loads.start_waiting()
        if self._save_pipeline is None or self._staging is None or not meta.saves or self._save_waves:
            return
        if not self.cache.puts_from(self.tp_rank):
            return  # a replica's bytes: the first rank of its replicas puts them
        saves = [save for save in meta.saves if save.request_id not in failed_loads]
        self.stats[SAVES_DROPPED_FAILED_LOAD] += len(meta.saves) - len(saves)
        staged = [staged for save in saves if (staged := self._stage(save)) is not None]
        if not staged:
            return
        # One batch for the step's every block; on a device it is still under way, and
        # the save pipeline (never this thread) waits for it before a put reads a slot.
        fence = self._staging.copy_in([copy for staged_save in staged for copy in staged_save.copies])
        ready = None if fence.done() else fence.wait
        for staged_save in staged:
            self._submit(staged_save, ready)
        self._reap()

    def _end_layered_saves(self, failed_loads: set[str]) -> None:
        """The step's forward is over: its layer-wise saves get the layers no hook announced, then its verdict."""
        if self._layered_step is None:
            return
        _, step, saves = self._layered_step
        self._layered_step = None
        self._copy_waves(step, saves, len(step.waves))
        ended = time.monotonic()
        for staged, layers in saves:
            if staged.request.request_id in failed_loads:
                layers.call_off()
                self.stats[SAVES_DROPPED_FAILED_LOAD] += 1
            if staged.job_id in self._job_slots:  # not failed and reaped already
                self._forward_ended[staged.job_id] = ended
        step.end()

    def _submit(self, staged: _StagedSave, ready: Callable[[], object] | None) -> int:
        """Hand a staged save to the save pipeline (``ready``: what it waits for before it reads the slots); its job's id."""
        assert self._save_pipeline is not None  # saves are staged only once it started
        job = self._save_pipeline.submit(staged.request, ready=ready)
        self.stats[SAVES_SUBMITTED] += 1
        self._job_slots[job.id] = [copy.slot for copy in staged.copies]
        if self.reporter is not None:
            self.reporter.planned(job.id, staged.request.request_id, staged.chunks)
        return job.id

    def _stage(self, save: SaveRequest) -> _StagedSave | None:
        """Free slots for the save's chunks: the copies that fill them, the request over them, its chunks.

        None: nothing to save, or no room. The free slots that loads waiting for slots
        want are no room (:meth:`.loads.Loads.slots_wanted` says why).
        """
        assert self._staging is not None and self._loads is not None  # both start with the save pipeline
        chunks = chunks_to_save(save, self.cache.store_groups, self.cache.hash_block_size)
        plan = [Placement(c.group.engine_group, c.block_index, c.block_id) for c in chunks]
        if not plan:
            return None
        if len(plan) > self._staging.free - self._loads.slots_wanted():
            self.stats[SAVES_DROPPED_NO_STAGING] += 1
            if self.reporter is not None:
                self.reporter.dropped(chunks)
            return None
        copies, ids = into_slots(self._staging, plan, save.block_ids)
        return _StagedSave(copies, replace(save, block_ids=ids), chunks)

    def _slots_held_by_saves(self) -> int:
        return sum(len(slots) for slots in self._job_slots.values())

    def _reap(self) -> None:
        """Free the staging slots of completed save jobs (counting their outcomes) and of given-up loads'."""
        if self._save_pipeline is not None:
            for job in self._save_pipeline.completed():
                self._reaped(job)
        if self._loads is not None:
            self._loads.reap_given_up()

    def _reap_next_save(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the next save job to complete, and reap it; whether one did."""
        job = None if self._save_pipeline is None else self._save_pipeline.next_completed(timeout_s)
        if job is None:
            return False
        self._reaped(job)
        return True

    def _reaped(self, job: Job) -> None:
        """A completed save job: free its staging slots, count its outcome."""
        assert self._staging is not None  # a save job's pipeline starts after the staging area
        self._staging.give_back(self._job_slots.pop(job.id, ()))
        self.stats[SEALS_FAILED] += job.counts.get("unsealed", 0)
        for count_name, stats_key in FAILED_BY_JOB_COUNT.items():
            if failed := job.counts.get(count_name):
                self.stats[stats_key] += failed
        assert job.outcome is not None  # a completed job has its outcome
        self.stats[SAVE_JOBS_BY_OUTCOME[job.outcome]] += 1
        forward_ended = self._forward_ended.pop(job.id, None)
        if job.outcome is Outcome.OK and job.finished_at is not None:
            # from the end of the forward that computed it to stored: when another replica can hit
            # it (a whole save is submitted then; a layer-wise one before the forward)
            self.landings.append(job.finished_at - (job.submitted_at if forward_ended is None else forward_ended))
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

    # -- loads (:mod:`.loads`) -----------------------------------------------------------

    def submit_loads(self, meta: KVPipeMetadata) -> None:
        """Start this step's loads now, once per step (:meth:`.loads.Loads.submit`)."""
        if self._loads is not None:
            self._loads.submit(meta)

    def start_load_kv(self, meta: KVPipeMetadata) -> None:
        """Submit this step's loads unless :meth:`submit_loads` did; wait for the sync ones (before the forward)."""
        if self._loads is not None:
            self._loads.before_forward(meta)

    def wait_for_layer_load(self, layer: str) -> None:
        """Before ``layer``'s attention: its bytes of the step's layer-wise loads are in (:meth:`.loads.Loads.wait_for_layer`)."""
        if self._loads is not None:
            self._loads.wait_for_layer(layer)

    def get_finished(self) -> set[str]:
        """Async loads whose jobs have ended since the last call, each reported once."""
        self._reap()
        return set() if self._loads is None else self._loads.finished()

    def take_failed_requests(self) -> set[str]:
        return set() if self._loads is None else self._loads.take_failed_requests()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self._loads is None else self._loads.take_failed_blocks()

    # -- telemetry -----------------------------------------------------------------------

    def take_layer_timeline(self) -> list[LayerWait]:
        """The layer waits of layer-wise loads since the last call, oldest first (:class:`.loads.LayerWait`)."""
        if self._loads is None:
            return []
        waits = list(self._loads.timeline)
        self._loads.timeline.clear()
        return waits

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
        for name, pipeline in self._running_pipelines().items():
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
        while self._job_slots and self._reap_next_save(max(0.0, deadline - time.monotonic())):
            pass
        return not self._job_slots

    def _running_pipelines(self) -> dict[str, SyncPipeline]:
        """The save and load pipelines by name, while they run (from start to shutdown)."""
        if self._save_pipeline is None or self._loads is None:
            return {}
        return {"save": self._save_pipeline, "load": self._loads.pipeline}

    def shutdown(self, owns_store: bool) -> None:
        """Stop the pipelines (each drains for at most :data:`STOP_DEADLINE_S`), let go of the memory.

        The loads stay: the load failures recorded and not yet taken are still
        told (:meth:`get_block_ids_with_load_errors`, :meth:`take_failed_requests`).
        """
        if self._layered_step is not None:  # a step that never ended: its layer-wise saves are called off
            for _, layers in self._layered_step[2]:
                layers.call_off()
            self._layered_step[1].end()
            self._layered_step = None
        stops: list[Callable[[float], object]] = [] if self._save_pipeline is None else [self._save_pipeline.stop]
        if self._loads is not None:
            stops.append(self._loads.stop)
        for stop in stops:
            try:
                stop(STOP_DEADLINE_S)
            except Exception as exc:  # noqa: BLE001 - shutdown goes on: the other pipeline, the store
                log.warning("pipeline stop failed", error=str(exc))
        self._reap()
        self._save_pipeline = None
        if self._staging is not None:
            self._staging.close()
        self._memory.unregister()
        if owns_store:
            self.store.close()

