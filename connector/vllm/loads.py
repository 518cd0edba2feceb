"""The worker's loads: from the store into the engine's blocks, and what failed, for vLLM.

Why a module of its own: the worker (:mod:`.worker`) sets the engine's memory up
and saves each step's blocks; a load lives longer and by other rules (a deadline,
giving up, waiting for slots, failures vLLM must hear of). The two meet only in
the staging area, whose slots the saves hold for the few milliseconds of their
puts. So a started worker has one :class:`Loads`, which owns the load pipeline
and every load in flight, and asks the worker about the saves (the slots they
hold; to wait for the next to end) rather than keeping a count of its own.

``submit`` (when vLLM binds the step's metadata, before the forward) submits the
step's loads to the load pipeline. Async loads return at once and are reported by
``finished`` once their job has ended, so the load runs while the engine steps
other requests; sync loads (the scheduler's choice, per load:
``KVPipeMetadata.sync_loads``) are waited for before the forward. Failed blocks go
to vLLM as block ids (one KV-cache group) or as a failed request (several groups:
vLLM cannot map block ids back then), and are recomputed under
``kv_load_failure_policy: recompute``. With ``load_layerwise``, a load that runs
in its request's step is read layer by layer while the forward runs instead: the
engine waits before each attention layer for that layer only, and the step's end
settles it. A load lands in staging slots (host memory,
checked there) and is copied into the engine's blocks on the engine's thread,
ordered before the next forward; one that finds saves holding the slots it needs
waits for them (by its deadline: an async one starts at a later hook, a sync one
before the forward). So a load can be given up: past its deadline its blocks fail
(vLLM recomputes them) and its request waits no longer, while the store call that
may still write its slots keeps them taken until it ends. A native call cannot be
cancelled, and one to a store node cut off by the network was measured to hold a
request 41.7 s. ``load_via_staging: false`` loads a CPU cache in place: one copy
less, and no giving up.

The calls, each on the engine's thread (the load stage reports failures on the
load pipeline's thread, into a thread-safe :class:`_LoadFailures`). None but
``stop`` raises: what goes wrong in a load is its blocks' failure, which vLLM recomputes.

- :meth:`Loads.submit`: start a step's loads, once per step's metadata.
- :meth:`Loads.before_forward`: the same, then wait for the step's sync loads and
  copy them home (ordered before the forward).
- :meth:`Loads.wait_for_layer`: before a layer's attention, that layer of the
  step's layer-wise loads is in the engine's blocks (docs/layerwise.md).
- :meth:`Loads.after_forward`: at the step's end, its layer-wise loads settled
  (judged whole); the requests whose loads failed in the step, whose saves go.
- :meth:`Loads.finished`: the async loads whose jobs ended (or were given up) since
  the last call, each reported once, copied home.
- :meth:`Loads.take_failed_blocks`, :meth:`Loads.take_failed_requests`: what failed
  since the last call, for vLLM (each told once).
- :meth:`Loads.start_waiting`, :meth:`Loads.slots_wanted`: for the saves: start the
  loads the slots given back let start; the free slots waiting loads want (a save
  takes none of them).
- :meth:`Loads.reap_given_up`: give back the slots of given-up loads whose calls ended.
- :meth:`Loads.before_sleep`: before vLLM's sleep frees the KV caches: nothing
  starts, and the loads in flight have ended.
- :meth:`Loads.stop`: at shutdown: nothing starts or finishes after, but what
  failed is still told to whoever asks.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import structlog

from kvpipe.connector.store.protocol import Store
from kvpipe.pipeline import Job, SyncPipeline
from kvpipe.stages import KVCache, LoadRequest, Verdict, default_load_graph
from kvpipe.stages.load_plan import load_chunks, touched_block_ids
from kvpipe.stages.model import Wave
from kvpipe.stages.retention import LoadedKeys

from .engine_cache import EngineCache
from .layer_arrivals import LayerArrivals
from .metrics import (
    CHUNKS_BY_VERDICT,
    CHUNKS_LOAD_FAILED,
    CHUNKS_LOADED,
    CHUNKS_LOADED_FROM_OTHERS,
    LOADS,
    LOADS_FAILED_NO_STAGING,
    LOADS_GIVEN_UP,
    LOADS_LAYER_LATE,
    LOADS_LAYERED,
    LOADS_WAITED_FOR_STAGING,
)
from .settings import ConnectorSettings
from .staging_area import Placement, SlotCopy, StagingArea, into_slots

if TYPE_CHECKING:
    from .messages import KVPipeMetadata

log = structlog.get_logger("kvpipe.connector.vllm")

#: the outer bound on waiting for a sync load; its job's deadline ends it long before
LOAD_TIMEOUT_S = 60.0
#: the layer waits kept for :attr:`Loads.timeline`, the oldest going first
TIMELINE_KEPT = 4096


class LayerWait(NamedTuple):
    """One layer of a step's first layer-wise load, as the forward met it (``time.monotonic`` seconds).

    ``asked``: the forward reached the layer (its wait began); ``landed``: the
    load stage told the layer's bytes in (None: never); ``returned``: the layer's
    attention could start (its bytes copied home, or given up).
    """

    layer: str
    wave: int
    asked: float
    landed: float | None
    returned: float


@dataclass
class LoadInFlight:
    """A load: its job (None: not started), and the slots it lands in first (unless in place).

    A load that found the staging slots held by saves waits for them
    (``slots_wanted``, until ``waits_until``) before its job starts; one whose job
    never starts fails whole.
    """

    request: LoadRequest  # over engine block ids
    job: Job | None  # its item is the request over the slots it lands in
    bounce: list[SlotCopy] = field(default_factory=list)
    via_slots: bool = False  # nothing it writes reaches the engine before it is settled (unless layered)
    waves_home: int = 0  # layered: the waves (from the first) in the engine's blocks, copied home or landed
    late: bool = False  # layered: the forward reached a layer before its wave had landed
    slots_wanted: list[Placement] | None = None  # waiting for free slots: where its chunks go
    waits_until: float = math.inf  # when a load waiting for slots fails instead

    @property
    def layered(self) -> bool:
        """It is read layer by layer while its step's forward runs."""
        return self.request.layered

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


class _LoadFailures:
    """What failed in the loads, from the load stage's report to vLLM's questions; thread-safe.

    The load stage tells a request's failed blocks on the load pipeline's thread;
    the loads settle them into what vLLM asks for: failed block ids (one KV-cache
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


class Loads:
    """One started worker's loads (see the module docstring): the load pipeline and every load in flight."""

    def __init__(
        self,
        cache: EngineCache,
        settings: ConnectorSettings,
        staging: StagingArea,
        kv: KVCache,
        store: Store,
        *,
        via_staging: bool,
        loaded_keys: LoadedKeys | None,
        stats: Counter[str],
        put_here: Container[bytes],
        slots_held_by_saves: Callable[[], int],
        reap_next_save: Callable[[float], bool],
        layers: Sequence[str] = (),
    ) -> None:
        """Start the load pipeline, which loads into ``kv`` from ``store``.

        ``kv``: the staging slots' layouts, or the engine's blocks unless ``via_staging``;
        ``loaded_keys`` hears of every object loaded (the saves' pin budget).
        The worker's, which the loads share: ``stats``, its counters (the loads count
        into them); ``put_here``, the chunk hashes it put (a load of others' chunks is
        counted as such); ``slots_held_by_saves()``, the staging slots its saves in
        flight hold; ``reap_next_save(timeout_s)``, wait at most that long for a save
        to end and give its slots back, and say whether one did. ``layers``: the
        layers the forward runs, in order, one per wave of ``kv.layer_waves``
        (whose first group's waves the copies home follow), for layer-wise loads;
        empty: none.

        Raises what starting a pipeline raises (:meth:`~kvpipe.pipeline.SyncPipeline.start`).
        """
        self._cache = cache
        self._settings = settings
        self._staging = staging
        self._via_staging = via_staging
        self._stats = stats
        self._put_here = put_here
        self._slots_held_by_saves = slots_held_by_saves
        self._reap_next_save = reap_next_save
        self._in_flight: dict[str, LoadInFlight] = {}  # async loads, by request id
        self._sync: list[LoadInFlight] = []  # this step's, submitted, waited for in before_forward
        self._given_up: list[LoadInFlight] = []  # settled past their deadlines, their calls still running
        self._waiting: deque[LoadInFlight] = deque()  # for saves to give slots back, first come first served
        self._submitted: KVPipeMetadata | None = None  # the step whose loads went out
        self._stopped = False  # by stop: nothing starts, nothing is reported finished
        self._failures = _LoadFailures()
        self._failed_in_step: set[str] = set()  # requests computed in this step whose loads failed
        self._waves: tuple[Wave, ...] = next(iter(kv.layer_waves.values()), ()) if layers else ()
        self._wave_of = {name: wave for wave, name in enumerate(layers)}
        # waves up to the last that holds bytes: each must be home before the forward reads it
        self._waves_needed = max((wave + 1 for wave, ranges in enumerate(self._waves) if ranges), default=0)
        self._arrivals = LayerArrivals()
        self._layered: list[LoadInFlight] = []  # this step's layer-wise loads, settled after its forward
        #: where a step's time went, layer by layer (the first layer-wise load of each step; bench's timeline)
        self.timeline: deque[LayerWait] = deque(maxlen=TIMELINE_KEPT)
        self.pipeline = SyncPipeline(
            default_load_graph(
                kv,
                store,
                load_observer=self._failures.told,
                max_buffers_per_call=settings.max_buffers_per_call,
                integrity=settings.integrity,
                loaded_keys=loaded_keys,
                layer_observer=self._arrivals if self._waves else None,
            ),
            queue_capacity=settings.queue_capacity,
            when_full="wait",
            name="kvpipe-load",
            job_deadline_s=settings.load_deadline_s,
            nice=settings.load_nice,
        ).start()

    @property
    def in_flight(self) -> Mapping[str, LoadInFlight]:
        """The async loads submitted and not yet reported by :meth:`finished`, by request id."""
        return self._in_flight

    def submit(self, meta: KVPipeMetadata) -> None:
        """Start this step's loads now, once per step (vLLM binds the step's metadata before its forward).

        vLLM calls ``start_load_kv`` before the forward only when the step has a
        sync load, and after it otherwise. On a CPU engine, whose forward returns
        when it is done, an async load would then start a whole forward late and
        its request compute a step later: so loads start here, when the metadata
        is bound, and :meth:`before_forward` waits for the sync ones.
        """
        if self._stopped or not meta.loads or meta is self._submitted:
            return
        self._submitted = meta
        for load in meta.loads:
            sync = load.request_id in meta.sync_loads
            submitted = self._submit_load(replace(load, layered=True) if sync and self._waves else load)
            if submitted.layered:
                self._layered.append(submitted)
                self._stats[LOADS_LAYERED] += 1
            elif sync:
                self._sync.append(submitted)
            else:
                self._in_flight[load.request_id] = submitted

    def before_forward(self, meta: KVPipeMetadata) -> None:
        """Submit this step's loads unless :meth:`submit` did; wait for the sync ones (before the forward).

        A layer-wise load only has its slots by now (it waited for saves to give
        them back, if it had to): its layers are waited for one by one
        (:meth:`wait_for_layer`).
        """
        self.submit(meta)
        waited, self._sync = self._sync, []
        if self._stopped:
            return
        for load in self._layered:
            self._wait_for_slots(load)
        for load in waited:
            self._wait_for_slots(load)
            if load.job is not None and not load.job.wait(load.wait_s()):
                what = "load given up at its deadline" if load.via_slots else "load timed out"
                log.warning(what, request_id=load.request.request_id)
        self._settle_loads(waited, reported=False)
        if waited:
            self.pipeline.completed()  # their completions: nothing waits for them now

    def wait_for_layer(self, layer: str) -> None:
        """Before ``layer``'s attention: its wave of this step's layer-wise loads is in the engine's blocks.

        Waits for the wave to land (each load's deadline bounds it), then copies
        it home from the staging slots, ordered before the layer's kernels; a
        wave that does not land in time makes its load late: it fails whole in
        this step (:meth:`after_forward`). Layers the loads do not know return at once.
        """
        wave = self._wave_of.get(layer)
        if wave is None or not self._layered:
            return
        asked = time.monotonic()
        for load in self._layered:
            if load.job is None or load.late or load.waves_home > wave:
                continue
            if not self._arrivals.wait(load.job, wave, load.wait_s()):
                load.late = True
                if not load.job.done:
                    log.warning("a layer's load was late", request_id=load.request.request_id, layer=layer)
                continue
            if load.via_slots:
                for home in range(load.waves_home, wave + 1):
                    if self._waves[home]:
                        self._staging.copy_out(load.bounce, self._waves[home])
            load.waves_home = wave + 1
        first = self._layered[0].job
        landed = None if first is None else self._arrivals.told_at(first, wave)
        self.timeline.append(LayerWait(layer, wave, asked, landed, time.monotonic()))

    def after_forward(self) -> set[str]:
        """At the step's end: settle its layer-wise loads; the requests whose loads failed in this step.

        Each layer-wise load's job is waited for (by its deadline): its objects are
        judged whole, and one that fails its check fails its blocks now, in the
        step that read them, so vLLM throws the step's work for the request away
        and recomputes. A load a layer of which the forward reached before it was
        home (late, or never waited for) fails whole. The requests returned (sync
        loads' too) computed this step over failed blocks: nothing of it is saved.
        """
        layered, self._layered = self._layered, []
        for load in layered:
            if load.job is not None and not load.job.wait(load.wait_s()):
                log.warning("layer-wise load given up at its deadline", request_id=load.request.request_id)
            if load.job is not None and load.waves_home < self._waves_needed:
                load.late = True
        self._settle_loads(layered, reported=False)
        if layered:
            self.pipeline.completed()  # their completions: nothing waits for them now
        failed, self._failed_in_step = self._failed_in_step, set()
        return failed

    def finished(self) -> set[str]:
        """Async loads whose jobs have ended (or that were given up) since the last call, each reported once."""
        if self._stopped or not self._in_flight:
            return set()
        self.start_waiting()
        self.pipeline.completed()
        finished = {rid for rid, load in self._in_flight.items() if load.over}
        self._settle_loads([self._in_flight.pop(rid) for rid in finished], reported=True)
        return finished

    def take_failed_requests(self) -> set[str]:
        """Requests whose loads failed since the last call (several KV-cache groups: vLLM recomputes them whole)."""
        return self._failures.take_requests()

    def take_failed_blocks(self) -> set[int]:
        """Engine block ids whose loads failed since the last call (one KV-cache group)."""
        return self._failures.take_blocks()

    def _submit_load(self, load: LoadRequest) -> LoadInFlight:
        """Submit one load (into staging slots first, unless in place).

        The scheduler plans no more loads than the slots hold, but saves hold slots
        too, for the few milliseconds of their puts: a load that finds too few free
        waits for the saves in flight to give theirs back (its job starts at a later
        hook, in arrival order, by its deadline); one that they could not make room
        for fails whole at once.
        """
        self._stats[LOADS] += 1
        if not self._via_staging:
            return LoadInFlight(load, self.pipeline.submit(load))
        plan = self._load_plan(load)
        submitted = LoadInFlight(load, None, slots_wanted=plan)
        if not plan or (not self._waiting and len(plan) <= self._staging.free):
            self._start(submitted)  # a load of nothing (or one the stage refuses) takes no slot: no line
        elif len(plan) <= self._staging.free + self._slots_held_by_saves():
            submitted.waits_until = time.monotonic() + self._settings.load_deadline_s
            self._waiting.append(submitted)
            self._stats[LOADS_WAITED_FOR_STAGING] += 1
        else:
            self._fail_waiting(submitted)
        return submitted

    def _start(self, load: LoadInFlight) -> None:
        """Start a load's job into free slots (it has waited for them, or found them free)."""
        assert load.slots_wanted is not None
        copies, ids = into_slots(self._staging, load.slots_wanted, load.request.block_ids)
        load.job = self.pipeline.submit(replace(load.request, block_ids=ids))
        load.bounce, load.via_slots, load.slots_wanted = copies, True, None

    def _fail_waiting(self, load: LoadInFlight) -> None:
        """A load that never starts: it fails whole (its request's blocks are recomputed)."""
        load.slots_wanted = None
        self._stats[LOADS_FAILED_NO_STAGING] += 1

    def slots_wanted(self) -> int:
        """Free slots the loads waiting for slots want: a save takes none of them.

        A load is on its request's way to its first token, and saves taking each
        slot given back would keep it waiting until its deadline, and then the
        engine would compute the whole prefix again; a save dropped costs a later reuse.
        """
        return sum(len(load.slots_wanted or ()) for load in self._waiting)

    def start_waiting(self) -> None:
        """Start the loads waiting for slots that the saves have given back, in order; fail the expired.

        The worker calls it before a step's saves take slots: the slots given back go to these loads first.
        """
        now = time.monotonic()
        while self._waiting and not self._stopped:
            load = self._waiting[0]
            assert load.slots_wanted is not None
            if len(load.slots_wanted) <= self._staging.free:
                self._start(self._waiting.popleft())
            elif now >= load.waits_until or len(load.slots_wanted) > self._staging.free + self._slots_held_by_saves():
                self._fail_waiting(self._waiting.popleft())
            else:
                return

    def _wait_for_slots(self, load: LoadInFlight) -> None:
        """Before the forward: until a sync load waiting for slots has them, or its deadline has passed."""
        while load.waiting:
            left = load.waits_until - time.monotonic()
            save_ended = left > 0 and self._reap_next_save(left)
            self.start_waiting()
            if not save_ended and load.waiting:  # no save ended by its deadline
                self._waiting.remove(load)
                self._fail_waiting(load)

    def _load_plan(self, load: LoadRequest) -> list[Placement]:
        """Where every chunk the load fills lies in the engine (none if the load is invalid)."""
        try:
            chunks = load_chunks(self._cache.store_groups, self._cache.hash_block_size, load)
        except ValueError:
            return []  # the load stage refuses it with the reason; its blocks fail
        return [Placement(chunk.group.engine_group, chunk.block_index, chunk.block_id) for chunk in chunks]

    def _settle_loads(self, loads: Sequence[LoadInFlight], reported: bool) -> None:
        """Loads whose jobs have ended (or timed out): settle each, then copy their bounced blocks home.

        One batch for them all, ordered before the engine's next forward without
        waiting for it here; their slots are reused once it is done.
        """
        home: list[SlotCopy] = []
        slots: list[int] = []
        for load in loads:
            given_up = not load.done  # read once: its job may end on the pipeline's thread meanwhile
            failed = self._settle_load(load, reported, given_up)
            if load.layered and load.job is not None:
                self._arrivals.forget(load.job)
            if given_up:
                self._given_up.append(load)  # its call may still write its slots: they stay taken
            elif load.bounce:
                if not load.layered:  # a layer-wise load's waves went home as they landed
                    home.extend(copy for copy in load.bounce if copy.block not in failed)
                slots.extend(copy.slot for copy in load.bounce)
        if slots:
            if home:
                self._staging.copy_out(home)
            self._staging.give_back(slots)

    def _settle_load(self, load: LoadInFlight, reported: bool, given_up: bool) -> set[int]:
        """A load whose job has ended: count it, record what failed; the engine blocks that failed.

        ``reported``: an async load, whose end :meth:`finished` reports (a sync one's is not).
        """
        job, rid = load.job, load.request.request_id
        told = None if job is None or given_up else self._failures.take_told(job.item)
        if given_up:
            self._stats[LOADS_GIVEN_UP] += 1
        if load.late:
            self._stats[LOADS_LAYER_LATE] += 1
        if told is None or load.late:
            # never started, given up, late, or refused before the stage: every block of its range
            # (not the blocks below it: those are the engine's own, maybe shared with others)
            failed = set(touched_block_ids(self._cache.store_groups, load.request))
        else:
            by_slot = {copy.slot: copy.block for copy in load.bounce}
            failed = {by_slot.get(block, block) for block in told}
        if job is not None:
            self._stats[CHUNKS_LOADED] += job.counts.get("loaded", 0)
            self._stats[CHUNKS_LOAD_FAILED] += job.counts.get("failed", 0)
            for verdict in Verdict:
                if count := job.counts.get(f"integrity_{verdict.value}", 0):
                    self._stats[CHUNKS_BY_VERDICT[verdict]] += count
        if not failed:
            self._stats[CHUNKS_LOADED_FROM_OTHERS] += self._stored_elsewhere(load.request)
            return failed
        # vLLM cannot map block ids of several groups back
        self._failures.record(rid, failed, as_request=len(self._cache.groups) > 1 and reported)
        if not reported:
            self._failed_in_step.add(rid)  # computed in this step over the failed blocks
        return failed

    def _stored_elsewhere(self, load: LoadRequest) -> int:
        """The chunks of a whole load this worker did not put (of the last it remembers)."""
        try:
            chunks = load_chunks(self._cache.store_groups, self._cache.hash_block_size, load)
        except ValueError:
            return 0
        return sum(1 for chunk in chunks if chunk.chunk_hash not in self._put_here)

    def reap_given_up(self) -> None:
        """Give back the staging slots of given-up loads whose store calls have ended (too late to matter)."""
        if not self._given_up:
            return
        running: list[LoadInFlight] = []
        for load in self._given_up:
            if not load.done:
                running.append(load)
                continue
            assert load.job is not None  # a given-up load had started
            self._failures.take_told(load.job.item)  # too late to matter
            if load.layered:
                self._arrivals.forget(load.job)  # the waves it told after it was given up
            self._staging.give_back([copy.slot for copy in load.bounce])
        self._given_up = running

    def before_sleep(self) -> None:
        """Before vLLM's sleep mode frees the KV caches: no load starts, and those in flight have ended.

        A load waiting for slots fails (had it started now, it would be copied into
        memory being freed); the others are waited for (their jobs' deadlines bound the wait).
        """
        while self._waiting:
            self._fail_waiting(self._waiting.popleft())
        for load in [*self._in_flight.values(), *self._sync, *self._layered]:
            if load.job is not None and not load.job.wait(LOAD_TIMEOUT_S):
                log.warning("a load outlived its wait before sleep", request_id=load.request.request_id)

    def stop(self, deadline_s: float) -> None:
        """Stop the load pipeline (see :meth:`~kvpipe.pipeline.SyncPipeline.stop`); idempotent.

        Nothing starts or is reported finished after; what failed and was not yet
        taken is still told (:meth:`take_failed_blocks`, :meth:`take_failed_requests`).
        Raises what stopping the pipeline raises.
        """
        if not self._stopped:
            self._stopped = True
            self.pipeline.stop(deadline_s)
