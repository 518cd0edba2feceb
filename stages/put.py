"""The ``put`` stage: copy the records' buffers into the store (the end of the save path).

Calls are sized by buffer count, not record count: the transport refuses a call
with more than about 2048 buffers to one peer (and may keep failing after), and
each buffer costs tens of microseconds, so the budget is what bounds a call. The
parallel keys/pointers/sizes/group-id lists the API wants are built from the
records of one call, right before it, and never outlive it, so position i of every
list always describes the same object.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpipe.pipeline.priority import cpu_wait_seconds
from kvpipe.pipeline.stage import BatchEntry, BatchStage, Emit

from .backoff import Backoff
from .batch_calls import StoreCallError, call_per_key, remove_each
from .integrity import SEAL_SIZE, Seal, entry_of, seal_key, seal_spans
from .model import Records, StoreObject
from .object_status import DEADLINE_PASSED, ObjectObserver, ObjectReporter
from .retention import LoadedKeys, PinBudget
from .seal import SealMemory, SealSlab
from .store import EXISTS, MAX_SOFT_PIN_TTL_S, Code, SavingStore, describe
from .throttle import DEFAULT_THROTTLE, SlowStoreThrottle, ThrottleParams

#: The buffer budget of one store call (puts and gets alike): the transport refuses a
#: call with more than about 2048 buffers to one peer, and may keep failing after.
MAX_BUFFERS_PER_CALL = 2048

ROLLED_BACK = "removed again: another object of its chunk was refused"
TORN_BEFORE = "not put: another object of its chunk was removed again after a refusal"
#: How long a rolled-back chunk is remembered: longer than a record spends between the
#: filter's answer and its put (the queues between them hold milliseconds of work).
TORN_MEMORY_S = 30.0


def _unit(record: StoreObject) -> str:
    """What two batches must not put at once: a record's chunk (under group semantics), or its key."""
    return record.group_id or record.key


class PutParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_buffers_per_call: int = Field(MAX_BUFFERS_PER_CALL, gt=0)
    backoff_initial_s: float = Field(0.01, ge=0)
    backoff_max_s: float = Field(0.2, ge=0)
    #: how long refused records keep being tried with no try storing any (``_put_making_room``)
    space_wait_s: float = Field(1.5, ge=0)
    throttle: ThrottleParams | None = DEFAULT_THROTTLE  # None: never skip a put
    #: store each object's seal beside it (:mod:`.integrity`); false: ``integrity: off``
    seal: bool = True
    #: retention (:mod:`.retention`): the bytes this stage may hold soft-pinned at once
    #: (0: pin nothing), and how long each pin lasts
    max_pinned_bytes: int = Field(0, ge=0)
    soft_pin_ttl_s: float = Field(600.0, gt=0, le=MAX_SOFT_PIN_TTL_S)

    @model_validator(mode="after")
    def _backoff_grows(self) -> PutParams:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s ({self.backoff_max_s}) must be >= "
                f"backoff_initial_s ({self.backoff_initial_s})"
            )
        return self


#: key -> the jobs' records that put it (requests sharing a prefix share keys), first first
Holders = dict[str, list[tuple[Emit, StoreObject]]]


def _split_expired(
    call: Sequence[StoreObject], holders: Holders
) -> tuple[list[StoreObject], list[StoreObject]]:
    """``call``'s records some job still wants (within its deadline), and those every job gave up on."""
    expired: dict[int, bool] = {}  # per job (by id of its emit): asked once per call
    live, gone = [], []
    for record in call:
        for emit, _ in holders[record.key]:
            if (past := expired.get(id(emit))) is None:
                past = expired[id(emit)] = emit.expired
            if not past:
                live.append(record)
                break
        else:
            gone.append(record)
    return live, gone


def split_into_calls(
    records: Sequence[StoreObject], max_buffers: int, extra_per_record: int = 0
) -> list[list[StoreObject]]:
    """Runs of ``records`` whose buffer counts each sum to at most ``max_buffers``.

    A record counts its :attr:`~.model.StoreObject.transfer_count` plus
    ``extra_per_record`` (a load's seal, read in the same call).

    The objects of one chunk (one lifecycle group: every store group and shard of
    the same prefix) go into the same call whenever they fit the budget together,
    so a call boundary never leaves one half of a chunk stored and the other
    refused. Chunks keep the order of their first record. Every record must fit
    the budget on its own (the caller fails those that don't).
    """

    def cost(record: StoreObject) -> int:
        return record.transfer_count + extra_per_record

    if sum(map(cost, records)) <= max_buffers:
        return [list(records)] if records else []  # one call: every chunk is whole in it
    chunks: dict[bytes, list[StoreObject]] = {}
    for record in records:
        chunks.setdefault(record.chunk_hash, []).append(record)
    calls: list[list[StoreObject]] = []
    current: list[StoreObject] = []
    used = 0

    def add(unit: list[StoreObject], buffers: int) -> None:
        nonlocal current, used
        if current and used + buffers > max_buffers:
            calls.append(current)
            current, used = [], 0
        current.extend(unit)
        used += buffers

    for unit in chunks.values():
        unit_buffers = sum(map(cost, unit))
        if unit_buffers <= max_buffers:
            add(unit, unit_buffers)
        else:  # too big to keep together: fill calls record by record
            for record in unit:
                add([record], cost(record))
    if current:
        calls.append(current)
    return calls


@dataclass(frozen=True, slots=True)
class _CallLayout:
    """The parallel lists of one put call, and where each record and each span's seal sit in them."""

    keys: list[str]
    ptrs: list[Sequence[int]]
    sizes: list[Sequence[int]]
    group_ids: list[str]
    data_positions: list[int]  # per record of the call
    seal_positions: list[int]  # per span

    @classmethod
    def of(cls, call: Sequence[StoreObject], spans: Sequence[Sequence[int]], slab: SealSlab | None) -> _CallLayout:
        """Records in their order, each span's seal (in ``slab``'s slot of its number) right after its last record."""
        layout = cls([], [], [], [], [], [0] * len(spans))
        closing: dict[int, list[int]] = {}  # record position -> the spans whose last record it is
        for number, span in enumerate(spans):
            closing.setdefault(max(span), []).append(number)
        for index, record in enumerate(call):
            addresses, lengths = record.transfer_spans()
            layout.data_positions.append(len(layout.keys))
            layout._add(record.key, addresses, lengths, record.group_id)
            for number in closing.get(index, ()):
                assert slab is not None
                anchor = call[spans[number][0]]
                layout.seal_positions[number] = len(layout.keys)
                layout._add(seal_key(anchor.key), [slab.address(number)], [SEAL_SIZE], anchor.group_id)
        return layout

    def _add(self, key: str, addresses: Sequence[int], lengths: Sequence[int], group_id: str | None) -> None:
        self.keys.append(key)
        self.ptrs.append(addresses)
        self.sizes.append(lengths)
        self.group_ids.append(group_id or "")


class PutStage(BatchStage):
    """Records -> stored objects. A sink: it emits nothing, it reports per record."""

    ports: ClassVar[tuple[str, ...]] = ()
    input_type: ClassVar[Any] = Records

    def __init__(
        self,
        params: PutParams,
        store: SavingStore,
        observer: ObjectObserver | None = None,
        cpu_wait: Callable[[], float] = cpu_wait_seconds,
        fingerprint: bytes | None = None,
        loads: LoadedKeys | None = None,
    ) -> None:
        """``fingerprint``: the cache's (:func:`~.integrity.fingerprint`), for the seals; None: no seals.

        ``loads``: the keys the load stage of the same engine loads, which count as
        requests for the chunks this stage holds pinned (:class:`~.retention.PinBudget`).
        """
        self._store = store
        self._cpu_wait = cpu_wait
        self._reporter = ObjectReporter(observer)
        self._max_buffers = params.max_buffers_per_call
        self._backoff = Backoff(params.backoff_initial_s, params.backoff_max_s)
        self._space_wait_s = params.space_wait_s
        self._fingerprint = fingerprint
        self._seals = SealMemory(store, params.max_buffers_per_call)  # registered at the first sealed put
        self.throttle = None if params.throttle is None else SlowStoreThrottle(params.throttle)
        self._pins = (
            PinBudget(params.max_pinned_bytes, params.soft_pin_ttl_s, loads=loads)
            if params.max_pinned_bytes
            else None
        )
        #: chunk (group id, else key) -> set when the batch putting it is done (see :meth:`_claim`)
        self._in_flight: dict[str, anyio.Event] = {}
        #: group id -> when this stage rolled its chunk back, and the keys it removed (see :meth:`_fail_torn`)
        self._torn: dict[str, tuple[float, frozenset[str]]] = {}

    @property
    def _seal_buffers(self) -> int:
        """The buffers a record's seal adds to a call."""
        return 0 if self._fingerprint is None else 1

    async def process_batch(self, batch: Sequence[BatchEntry[Records]]) -> None:
        try:
            await self._put_batch(batch)
        finally:  # staged copies are no longer read once their put returned, whatever it said
            for entry in batch:
                for record in entry.item:
                    if record.staging is not None:
                        record.staging.release()

    async def _put_batch(self, batch: Sequence[BatchEntry[Records]]) -> None:
        holders: Holders = {}
        for entry in batch:
            emit = entry.emit
            for record in entry.item:
                if (count := record.transfer_count + self._seal_buffers) > self._max_buffers:
                    self._reporter.failed(
                        emit,
                        record,
                        f"put {record.key}: {count} buffers exceed "
                        f"max_buffers_per_call={self._max_buffers}; not sent",
                    )
                elif (sharing := holders.get(record.key)) is None:
                    holders[record.key] = [(emit, record)]
                else:
                    sharing.append((emit, record))
        units = {_unit(holding[0][1]) for holding in holders.values()}
        done = await self._claim(units)
        try:
            await self._fail_torn(holders)
            # requests sharing a prefix share keys: each key is put once
            first_of_each_key = [holding[0][1] for holding in holders.values()]
            pinned, unpinned = await self._pinned(first_of_each_key, holders)
            calls = [(call, True) for call in split_into_calls(pinned, self._max_buffers, self._seal_buffers)]
            calls += [
                (call, False) for call in split_into_calls(unpinned, self._max_buffers, self._seal_buffers)
            ]
            for offered, pin in calls:
                stored = await self._put_call(offered, pin, holders)
                if pin and self._pins is not None:
                    for record in offered:  # a pin whose put did not store its object holds nothing
                        if record.key not in stored:
                            self._pins.release(record.key)
        finally:
            for unit in units:
                del self._in_flight[unit]
            done.set()

    async def _claim(self, units: set[str]) -> anyio.Event:
        """Wait until no other batch is putting any of ``units``, then mark them in flight; the batch's event.

        The filter asks the store in batches, so a chunk can be answered absent to
        the next batch while this stage's other worker is still putting it. Two puts
        of one chunk must not overlap: under group semantics one's rollback of a torn
        chunk would remove objects the other counts as stored. A batch that holds
        units never waits (it claims all of its units at once, between two awaits),
        so two batches cannot wait on each other.
        """
        while busy := next((self._in_flight[unit] for unit in units if unit in self._in_flight), None):
            await busy.wait()
        done = anyio.Event()
        for unit in units:
            self._in_flight[unit] = done
        return done

    async def _fail_torn(self, holders: Holders) -> None:
        """Fail (and drop from ``holders``) the records of chunks whose objects this stage removed since.

        The filter may have answered "stored" for some objects of a chunk just
        before another batch rolled that chunk back (:meth:`_remove_torn_chunks`):
        putting only the rest would leave the chunk partial. Such a chunk's removed
        keys are asked again (one call, only for chunks torn in the last
        :data:`TORN_MEMORY_S`); if any is still absent, the chunk is not put.
        """
        now = time.monotonic()
        while self._torn and now - next(iter(self._torn.values()))[0] > TORN_MEMORY_S:
            del self._torn[next(iter(self._torn))]
        if not self._torn:
            return  # the usual case: no chunk rolled back lately
        to_ask: dict[str, list[str]] = {}  # group id -> removed keys this batch does not put itself
        for holding in holders.values():
            group_id = holding[0][1].group_id
            if group_id in self._torn and group_id not in to_ask:
                to_ask[group_id] = [k for k in self._torn[group_id][1] if k not in holders]
        keys = [key for missing in to_ask.values() for key in missing]
        if not keys:
            return
        try:
            present = dict(zip(keys, await call_per_key(self, self._store.batch_is_exist, keys), strict=True))
            broken = {g for g, missing in to_ask.items() if any(present[k] != EXISTS for k in missing)}
        except StoreCallError:
            broken = set(to_ask)
        for key in [key for key, holding in holders.items() if holding[0][1].group_id in broken]:
            for emit, held in holders.pop(key):
                self._reporter.failed(emit, held, f"put {held.key}: {TORN_BEFORE}")

    async def _put_call(self, call: Sequence[StoreObject], pin: bool, holders: Holders) -> set[str]:
        """Put one call's records (``pin``: soft-pinned) and report each; the keys it stored."""
        # Checked per call, after any back-off: the calls before it (and the back-off) may
        # have outlasted a job's deadline, or shown the store to be slow.
        await self._backoff.wait()
        call = self._fail_expired(call, holders)
        if not call:
            return set()
        if self.throttle is not None and not self.throttle.allow():
            self._shed(call, holders)
            return set()
        try:
            codes, unsealed = await self._put_making_room(call, pin, holders)
        except StoreCallError as error:
            for record in call:
                for emit, held in holders[record.key]:
                    self._reporter.failed(emit, held, f"put {held.key}: {error}")
            return set()
        for key in unsealed:  # stored, but a load will find it unverified
            holders[key][0][0].count("unsealed")
        rolled_back = await self._remove_torn_chunks(call, codes)
        stored: dict[int, tuple[Emit, list[StoreObject]]] = {}  # per job, counted at once
        for record, code in zip(call, codes, strict=True):
            (emit, held), *sharers = holders[record.key]
            if rolled_back and record.key in rolled_back:
                for emit, held in holders[record.key]:
                    self._reporter.failed(emit, held, f"put {held.key}: {ROLLED_BACK}")
                continue
            if code == Code.OK:
                if (of_job := stored.get(id(emit))) is None:
                    stored[id(emit)] = (emit, [held])
                else:
                    of_job[1].append(held)
            else:
                self._settle(emit, held, code)
            for emit, held in sharers:  # their object is there now, stored for the first
                self._settle(emit, held, Code.ALREADY_EXISTS if code == Code.OK else code)
        for emit, records in stored.values():
            self._reporter.all_stored(emit, records)
            if pin:
                emit.count("pinned", len(records))
        return {record.key for _, records in stored.values() for record in records}

    async def _pinned(
        self, records: list[StoreObject], holders: Holders
    ) -> tuple[list[StoreObject], list[StoreObject]]:
        """``records`` split into those to put soft-pinned (reused, and admitted by the budget) and the rest.

        Pinned ones go first: they are the prefixes requests keep coming back to.
        The pins the budget demoted to admit them are removed from the store
        first, so that their bytes make the room (a leased one stays: it is being
        read, and its pin lapses with its TTL).
        """
        budget = self._pins
        if budget is None or not any(record.reuse for record in records):
            return [], records
        pinned: list[StoreObject] = []
        unpinned: list[StoreObject] = []
        demoted: list[str] = []
        for record in records:
            admitted = False
            if record.reuse:
                admitted, demotes = budget.admit(record.key, record.size, record.reuse)
                if demotes:
                    holders[record.key][0][0].count("demoted", len(demotes))
                    demoted += demotes
            (pinned if admitted else unpinned).append(record)
        if demoted:  # their seals stay: a seal may vouch for more of its span than the demoted object
            try:
                await call_per_key(self, remove_each, demoted, self._store, False)
            except StoreCallError:
                pass  # they stay until their pins lapse: the budget counts them gone all the same
        return pinned, unpinned

    def _fail_expired(self, call: Sequence[StoreObject], holders: Holders) -> list[StoreObject]:
        """Fail the records every holder of which is past its job's deadline; the rest."""
        live, expired = _split_expired(call, holders)
        for record in expired:
            for emit, held in holders[record.key]:
                self._reporter.failed(emit, held, f"put {held.key}: {DEADLINE_PASSED}")
        return live

    def _shed(self, call: list[StoreObject], holders: Holders) -> None:
        """Count ``call``'s records throttled in their jobs, without a store call."""
        by_job: dict[int, tuple[Emit, list[StoreObject]]] = {}
        for record in call:
            for emit, held in holders[record.key]:
                by_job.setdefault(id(emit), (emit, []))[1].append(held)
        for emit, records in by_job.values():
            self._reporter.all_throttled(emit, records)

    async def _put_making_room(
        self, call: Sequence[StoreObject], pin: bool, holders: Holders
    ) -> tuple[list[int], set[str]]:
        """:meth:`_put`, then again after each back-off for the records the store refused for space.

        Mooncake's master evicts on a timer (every ~10 ms) once a put has been
        refused: the refusal itself is what makes the room, so a try a back-off
        later stores what a cold object's eviction now fits, where giving up at
        once would refuse a put while evictable objects exist. With a disk tier
        the room comes later still: evicted objects leave memory only once the
        segment's owner has written them to disk, on its heartbeat (a second).
        So refused records are tried again, each time after the back-off, until
        ``space_wait_s`` has passed (at least once more) without a try storing
        any of them: each eviction round makes room for a few objects, so a
        burst several times the store's size drains over many rounds, while a
        store that stays full that long holds only leased or pinned objects,
        and the refusal stands. A
        record whose jobs all passed their deadline meanwhile keeps its refusal,
        and so does one whose chunk is partly stored.
        """
        codes, unsealed = await self._put(call, pin)
        give_up_at = time.monotonic() + self._space_wait_s
        # A chunk that is partly stored stays as it is (torn: rolled back by the caller); a
        # retry's eviction could take the stored part's group and leave the rest alone in it.
        stored_groups = {
            r.group_id for r, code in zip(call, codes, strict=True) if r.group_id and code == Code.OK
        }
        index = {id(record): position for position, record in enumerate(call)}
        while Code.NO_SPACE in codes:
            await self._backoff.wait()
            refused = [
                record
                for record, code in zip(call, codes, strict=True)
                if code == Code.NO_SPACE and record.group_id not in stored_groups
            ]
            retry, _ = _split_expired(refused, holders)
            if not retry:
                break
            again, unsealed_again = await self._put(retry, pin)
            for record, code in zip(retry, again, strict=True):
                codes[index[id(record)]] = code
                if record.group_id and code == Code.OK:
                    stored_groups.add(record.group_id)
            unsealed |= unsealed_again
            if Code.OK in again:  # the store is making room: the wait starts again
                give_up_at = time.monotonic() + self._space_wait_s
            elif time.monotonic() >= give_up_at:
                break
        return codes, unsealed

    async def _put(self, call: Sequence[StoreObject], pin: bool) -> tuple[list[int], set[str]]:
        """One store call for ``call``'s records and their seals (``pin``: soft-pinned), after any back-off.

        Returns per-record codes, and the keys of records stored whose seal was refused.
        Records go in their order; each span's seal (:func:`~.integrity.seal_spans`)
        right after its last record: a put of a key that exists keeps the first value
        and still answers 0, so two writers racing on one chunk can leave one's object
        beside the other's seal; adjacent keys keep that window as small as a call
        allows, and a load that meets such a pair removes it as damaged (a recompute,
        never a wrong byte).
        """
        slab = None if self._fingerprint is None else await self._seals.acquire(self)
        try:
            spans = seal_spans(call) if slab is not None else []
            layout = _CallLayout.of(call, spans, slab)
            seal = None
            if slab is not None:
                seal = functools.partial(self._write_seals, slab, call, spans, layout)
            codes = await self._timed_call(layout.keys, layout.ptrs, layout.sizes, layout.group_ids, seal, pin)
        finally:
            if slab is not None:
                slab.release()
        self._backoff.record(pressured=Code.NO_SPACE in codes)
        data_codes = [codes[position] for position in layout.data_positions]
        unsealed = {
            call[position].key
            for span, seal_position in zip(spans, layout.seal_positions, strict=True)
            if codes[seal_position] != Code.OK
            for position in span
            if data_codes[position] == Code.OK
        }
        return data_codes, unsealed

    def _write_seals(
        self,
        slab: SealSlab,
        call: Sequence[StoreObject],
        spans: Sequence[Sequence[int]],
        layout: _CallLayout,
    ) -> None:
        """Write each span's seal into its slot of ``slab`` (in the worker thread that makes the call).

        Sealing there reads the very bytes the put sends (a staging slot, or the
        engine's blocks) and costs no hop of its own; a staged copy whose checksum
        the gather took as it copied is not read again.
        """
        fingerprint_ = self._fingerprint
        assert fingerprint_ is not None
        for number, span in enumerate(spans):
            entries = []
            for index in span:
                position = layout.data_positions[index]
                staged = call[index].staging
                entries.append(
                    entry_of(
                        layout.keys[position],
                        layout.ptrs[position],
                        layout.sizes[position],
                        None if staged is None else staged.checksum,
                    )
                )
            slab.write(number, Seal(fingerprint_, tuple(entries)))

    async def _timed_call(
        self,
        keys: list[str],
        ptrs: list[Sequence[int]],
        sizes: list[Sequence[int]],
        group_ids: list[str],
        seal: Callable[[], None] | None,
        pin: bool,
    ) -> list[int]:
        """The put call itself (group ids where the store takes them); the throttle learns its time."""
        # fresh per call: overlapping puts must not share one
        pin_ttl_ms = self._pins.ttl_ms if pin and self._pins is not None else None
        config = self._store.new_replicate_config(soft_pin_ttl_ms=pin_ttl_ms)
        if self._store.supports_group_ids and any(group_ids):
            config.group_ids = group_ids
        spent: list[float] = []
        try:
            timed_put = functools.partial(self._timed_put, spent, seal)
            return await call_per_key(self, timed_put, keys, ptrs, sizes, config)
        finally:
            if self.throttle is not None and spent:
                self.throttle.record(spent[0], sum(map(sum, sizes)))

    def _timed_put(
        self,
        spent: list[float],
        seal: Callable[[], None] | None,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        config: Any,
    ) -> Sequence[int]:
        """Seal the objects (``seal``), put; append the store's seconds.

        The store's time is the call's less what this thread waited for a CPU:
        saves run nicer than the engine (:mod:`kvpipe.pipeline.priority`), so on a core
        the engine keeps busy a 20 ms put can take 300 ms of wall time, and a throttle
        fed wall time would shed saves while the store is fast.
        """
        if seal is not None:
            seal()
        started, waited = time.monotonic(), self._cpu_wait()
        try:
            return self._store.batch_put_from_multi_buffers(keys, ptrs, sizes, config)
        finally:
            spent.append(time.monotonic() - started - (self._cpu_wait() - waited))

    async def _remove_torn_chunks(self, call: Sequence[StoreObject], codes: list[int]) -> set[str]:
        """Under group semantics, undo the puts of a chunk whose other objects were refused.

        A chunk is reusable only whole (every stored group and shard), and with
        group ids the store evicts it whole; an object stored beside a refused
        sibling would only hold memory no reader can use. Its siblings sit in this
        same call (``split_into_calls`` keeps a chunk together), so the call's
        answers say whether the chunk is torn. Returns the keys removed.
        """
        if codes.count(Code.OK) + codes.count(Code.ALREADY_EXISTS) == len(codes):
            return set()  # nothing refused (the usual case, counted without a Python loop)
        refused = {
            record.group_id
            for record, code in zip(call, codes, strict=True)
            if record.group_id and code not in (Code.OK, Code.ALREADY_EXISTS)
        }
        if not refused:
            return set()
        torn = [
            r.key for r, code in zip(call, codes, strict=True) if code == Code.OK and r.group_id in refused
        ]
        if not torn:
            return set()
        try:
            results = await call_per_key(self, remove_each, torn, self._store, True)
        except StoreCallError:
            return set()  # they stay stored: reported as put, the chunk partial
        removed = {key for key, result in zip(torn, results, strict=True) if result == Code.OK}
        when = time.monotonic()
        for record in call:
            if record.key in removed and record.group_id:
                _, keys = self._torn.pop(record.group_id, (when, frozenset()))
                self._torn[record.group_id] = (when, keys | {record.key})  # last: newest
        return removed

    async def stop(self) -> None:
        if self._seals.allocated:
            await self.run_blocking(self._seals.close)

    def _settle(self, emit: Emit, record: StoreObject, code: int) -> None:
        """Report what became of one record, in its own job."""
        if code == Code.OK:
            self._reporter.stored(emit, record)
        elif code == Code.ALREADY_EXISTS:  # someone stored it first: the object is there
            self._reporter.existing(emit, record)
        else:
            if code == Code.NO_SPACE:
                emit.count("backpressure")
            self._reporter.failed(emit, record, f"put {record.key}: {describe(code)}")
