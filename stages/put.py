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

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpipe.pipeline.priority import cpu_wait_seconds
from kvpipe.pipeline.stage import BatchEntry, BatchStage, Emit

from .backoff import Backoff
from .batch_calls import MAX_BUFFERS_PER_CALL, StoreCallError, call_per_key, remove_each, split_into_calls
from .integrity import SEAL_SIZE, Seal, entry_of, seal_key, seal_spans
from .keys import layer_seal_key
from .layer_seals import layer_entry_of, layer_seal_size, pack_into
from .layers import wave_pieces
from .model import LayerProgress, Records, StoreObject, Wave
from .object_status import DEADLINE_PASSED, FailReason, ObjectObserver, ObjectReporter
from .retention import LoadedKeys, PinBudget
from .seal import SealMemory, SealSlab
from .store import EXISTS, MAX_SOFT_PIN_TTL_S, Code, SavingStore, describe
from .stored_lately import StoredLately
from .throttle import DEFAULT_THROTTLE, SlowStoreThrottle, ThrottleParams
from .torn_chunks import ROLLED_BACK, TornChunks, claim_unit


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

#: not a store's code: a layer-wise record whose step failed, or never ended (:meth:`PutStage._put_layer_by_layer`)
STEP_CALLED_OFF = -1001
#: how long a layer-wise put waits for the engine's next layer: a forward's layer takes
#: milliseconds; the engine calls every save off at its step's end, so this bounds only an engine gone
LAYER_WAIT_S = 60.0


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
    def of(
        cls,
        call: Sequence[StoreObject],
        spans: Sequence[Sequence[int]],
        slab: SealSlab | None,
        layer_slab: SealSlab | None = None,
    ) -> _CallLayout:
        """Records in their order, each span's seal (in ``slab``'s slot of its number) right after its last record,
        and its layer seal (in ``layer_slab``'s, if any) right after the seal."""
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
                if layer_slab is not None:
                    address, size = layer_slab.address(number), layer_slab.slot_bytes
                    layout._add(layer_seal_key(anchor.key), [address], [size], anchor.group_id)
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
        layer_waves: tuple[Wave, ...] = (),
    ) -> None:
        """``fingerprint``: the cache's (:func:`~.integrity.fingerprint`), for the seals; None: no seals.
        ``layer_waves``: the objects' waves (:mod:`.layers`): each seal gets a layer seal
        beside it (:mod:`.layer_seals`), for readers that load layer by layer; none: no layer seals.

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
        self._layer_waves = layer_waves if fingerprint is not None else ()
        self._layer_seals = (
            SealMemory(store, params.max_buffers_per_call, slot_bytes=layer_seal_size(len(layer_waves)))
            if self._layer_waves
            else None
        )
        self.throttle = None if params.throttle is None else SlowStoreThrottle(params.throttle)
        self._pins = (
            PinBudget(params.max_pinned_bytes, params.soft_pin_ttl_s, loads=loads)
            if params.max_pinned_bytes
            else None
        )
        #: when it stored each key lately, to find the filter's answers another batch outdated
        self._stored_lately = StoredLately()
        #: claims on the chunks in flight, and the chunks rolled back lately (:mod:`.torn_chunks`)
        self._torn_chunks = TornChunks(
            exist=lambda keys: call_per_key(self, self._store.batch_is_exist, keys),
            remove=lambda keys: call_per_key(self, remove_each, keys, self._store, True),
            reporter=self._reporter,
        )

    @property
    def _seal_buffers(self) -> int:
        """The buffers a record's seal (and layer seal) add to a call, at most."""
        return 0 if self._fingerprint is None else 1 if self._layer_seals is None else 2

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
                        FailReason.TOO_LARGE,
                    )
                elif (sharing := holders.get(record.key)) is None:
                    holders[record.key] = [(emit, record)]
                else:
                    sharing.append((emit, record))
        units = {claim_unit(holding[0][1]) for holding in holders.values()}
        done = await self._torn_chunks.claim(units)
        try:
            await self._torn_chunks.fail_torn(holders)
            await self._settle_stored_since(holders)
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
            self._torn_chunks.release(units, done)

    async def _settle_stored_since(self, holders: Holders) -> None:
        """Settle (and drop from ``holders``) the records whose key was stored since the filter asked.

        Another batch of this stage may have stored a key between the filter's
        answer and now (:mod:`.stored_lately`): put again, its record could anchor a
        seal span whose seal key holds the first writer's span, and the rest of the
        span would go unsealed. The store is asked only about the keys this stage
        stored since their records were made (usually none: no call), once no other
        batch puts them (the claims). A key it holds is existing in every holder's
        job; one it cannot answer for fails, as at the filter (never put blindly).
        """
        keys = self._stored_lately.stale(holders)
        if not keys:
            return
        try:
            answers = await call_per_key(self, self._store.batch_is_exist, keys)
        except StoreCallError as error:
            for key in keys:
                for emit, held in holders.pop(key):
                    self._reporter.failed(emit, held, f"exist {held.key}: {error}", FailReason.STORE_ERROR)
            return
        for key, answer in zip(keys, answers, strict=True):
            if answer == 0:  # gone since (evicted, removed): put it again
                continue
            for emit, held in holders.pop(key):
                if answer == EXISTS:
                    self._reporter.existing(emit, held)
                else:
                    message = f"exist {held.key}: {describe(answer)}"
                    self._reporter.failed(emit, held, message, FailReason.STORE_ERROR)

    async def _put_call(self, call: Sequence[StoreObject], pin: bool, holders: Holders) -> set[str]:
        """Put one call's records (``pin``: soft-pinned) and report each; the keys it stored."""
        # Checked per call, after any back-off: the calls before it (and the back-off) may
        # have outlasted a job's deadline, or shown the store to be slow.
        await self._backoff.wait()
        call = self._fail_expired(call, holders)
        if not call:
            return set()
        if self.throttle is not None and not self.throttle.allow():
            # another engine waits for a handoff's objects: shedding them would cost it the whole prompt
            waited_for = {
                record.key for record in call if any(held.handoff for _, held in holders[record.key])
            }
            self._shed([record for record in call if record.key not in waited_for], holders)
            call = [record for record in call if record.key in waited_for]
            if not call:
                return set()
        try:
            codes, unsealed = await self._put_making_room(call, pin, holders)
        except StoreCallError as error:
            for record in call:
                for emit, held in holders[record.key]:
                    self._reporter.failed(emit, held, f"put {held.key}: {error}", FailReason.STORE_ERROR)
            return set()
        rolled_back = await self._torn_chunks.remove_torn(call, codes)
        for key in unsealed - rolled_back:  # stored, but a load will find it unverified
            holders[key][0][0].count("unsealed")
        stored: dict[int, tuple[Emit, list[StoreObject]]] = {}  # per job, counted at once
        for record, code in zip(call, codes, strict=True):
            (emit, held), *sharers = holders[record.key]
            if rolled_back and record.key in rolled_back:
                for emit, held in holders[record.key]:
                    self._reporter.failed(
                        emit, held, f"put {held.key}: {ROLLED_BACK}", FailReason.ROLLED_BACK
                    )
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
        self._stored_lately.note(
            record.key
            for record, code in zip(call, codes, strict=True)
            if code in (Code.OK, Code.ALREADY_EXISTS) and not (rolled_back and record.key in rolled_back)
        )
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
                self._reporter.failed(emit, held, f"put {held.key}: {DEADLINE_PASSED}", FailReason.DEADLINE)
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
        layer_slab = None if slab is None or self._layer_seals is None else await self._layer_seals.acquire(self)
        try:
            spans = seal_spans(call) if slab is not None else []
            layout = _CallLayout.of(call, spans, slab, layer_slab)
            seal = None
            if slab is not None:
                seal = functools.partial(self._write_seals, slab, call, spans, layout, layer_slab)
            if any(record.layers is not None for record in call):
                codes = await self._layered_call(call, layout, seal, pin)
            else:
                codes = await self._timed_call(layout.keys, layout.ptrs, layout.sizes, layout.group_ids, seal, pin)
        finally:
            for held in (slab, layer_slab):
                if held is not None:
                    held.release()
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
        layer_slab: SealSlab | None = None,
    ) -> None:
        """Write each span's seal into its slot of ``slab`` (in the worker thread that makes the call),
        and its layer seal into ``layer_slab``'s, if any.

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
            if layer_slab is not None:
                layer_entries = [
                    layer_entry_of(call[index].key, call[index].transfer_buffers, entry.checksum, self._layer_waves)
                    for index, entry in zip(span, entries, strict=True)
                ]
                pack_into(layer_entries, len(self._layer_waves), layer_slab.view(number))

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
        pin_ttl_ms = self._pins.ttl_ms if pin and self._pins is not None else None
        config = self._config(pin_ttl_ms, group_ids)
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

    async def _layered_call(
        self, call: Sequence[StoreObject], layout: _CallLayout, seal: Callable[[], None] | None, pin: bool
    ) -> list[int]:
        """:meth:`_put_layer_by_layer` in a worker thread; per position of ``layout``, its code.

        The throttle does not learn its time: most of it is the engine computing layers.
        """
        pin_ttl_ms = self._pins.ttl_ms if pin and self._pins is not None else None
        try:
            return await self.run_blocking(self._put_layer_by_layer, call, layout, seal, pin_ttl_ms)
        except Exception as error:  # a store is outside our control: fail its records, not the pipeline
            raise StoreCallError(f"store call raised {type(error).__name__}: {error}") from error

    def _put_layer_by_layer(
        self,
        call: Sequence[StoreObject],
        layout: _CallLayout,
        seal: Callable[[], None] | None,
        pin_ttl_ms: int | None,
    ) -> list[int]:
        """Put ``call``: its layer-wise records a layer at a time as the engine computes them, then the rest.

        Each layer-wise object is reserved (a put session: invisible), written a
        wave at a time as its :class:`~.model.LayerProgress` says the engine's copy
        of that layer is readable, and once its step has ended well, sealed and
        made visible: the seals (and the call's other records) are put first, then
        the sessions end, so an object is never seen before its seal. An object
        whose step failed, never ended, or one of whose writes failed is revoked:
        never seen, half written or not. A writer killed midway leaves only
        reservations, which the master drops (docs/layerwise.md).
        """
        codes: list[int] = [Code.OK] * len(layout.keys)
        layered = {
            layout.data_positions[index]: record for index, record in enumerate(call) if record.layers is not None
        }
        positions = list(layered)
        config = self._config(pin_ttl_ms, [layout.group_ids[p] for p in positions])
        reserved = _answers(
            self._store.batch_put_session_start(
                [layout.keys[p] for p in positions], [layered[p].size for p in positions], config
            ),
            len(positions),
        )
        open_ = {}
        for position, code in zip(positions, reserved, strict=True):
            # -600: another writer's session holds the key; its object, as a whole put's 0 takes it
            codes[position] = Code.ALREADY_EXISTS if code == Code.INVALID_PARAMS else code
            if code == Code.OK:
                open_[position] = layered[position]
        failed = self._write_layers(open_, layout, codes)
        if seal is not None:
            seal()  # every layer is in: the checksums read what the objects hold
        rest = [position for position in range(len(layout.keys)) if position not in layered]
        if rest:
            config = self._config(pin_ttl_ms, [layout.group_ids[p] for p in rest])
            answers = self._store.batch_put_from_multi_buffers(
                [layout.keys[p] for p in rest], [layout.ptrs[p] for p in rest], [layout.sizes[p] for p in rest], config
            )
            for position, code in zip(rest, _answers(answers, len(rest)), strict=True):
                codes[position] = code
        ending = [position for position in open_ if position not in failed]
        if ending:
            ended = self._store.batch_put_session_end([layout.keys[p] for p in ending])
            for position, code in zip(ending, _answers(ended, len(ending)), strict=True):
                codes[position] = code
        if revoking := [layout.keys[position] for position in open_ if position in failed]:
            # one the store does not revoke stays unseen and goes at its discard timeout
            self._store.batch_put_session_revoke(revoking)
        return codes

    def _write_layers(self, open_: dict[int, StoreObject], layout: _CallLayout, codes: list[int]) -> set[int]:
        """Write the reserved objects of ``open_`` (by position) wave by wave; the positions that failed.

        Before each wave, every save's progress is waited for; after the last, each
        says whether its step ended well. A save called off (or whose engine never
        got there) fails its objects with :data:`STEP_CALLED_OFF`; a write the
        store refused fails its object with the store's code.
        """
        failed: set[int] = set()
        progresses: dict[int, LayerProgress] = {}
        for record in open_.values():
            assert record.layers is not None  # only layer-wise records are reserved
            progresses[id(record.layers)] = record.layers
        steps = max((len(progress.waves) for progress in progresses.values()), default=0)
        called_off: set[int] = set()  # ids of progresses whose step failed
        for step in range(steps + 1):
            for key, progress in progresses.items():
                if key not in called_off and not progress.wait(step, LAYER_WAIT_S):
                    called_off.add(key)
                    for position, record in open_.items():
                        if id(record.layers) == key and position not in failed:
                            failed.add(position)
                            codes[position] = STEP_CALLED_OFF
            writing = [
                (position, record, waves[step])
                for position, record in open_.items()
                if position not in failed
                and record.layers is not None
                and step < len(waves := record.layers.waves)
                and waves[step]
            ]
            if not writing:
                continue
            pieces = [wave_pieces(record.transfer_buffers, wave) for _, record, wave in writing]
            answers = self._store.batch_put_from_multi_buffer_ranges(
                [layout.keys[position] for position, _, _ in writing],
                [piece[0] for piece in pieces],
                [piece[1] for piece in pieces],
                [piece[2] for piece in pieces],
            )
            for (position, _, _), code in zip(writing, _answers(answers, len(writing)), strict=True):
                if code < 0:
                    failed.add(position)
                    codes[position] = code
        return failed

    def _config(self, pin_ttl_ms: int | None, group_ids: list[str]) -> Any:
        """A fresh replicate config (overlapping puts must not share one), with group ids where the store takes them."""
        config = self._store.new_replicate_config(soft_pin_ttl_ms=pin_ttl_ms)
        if self._store.supports_group_ids and any(group_ids):
            config.group_ids = group_ids
        return config

    async def stop(self) -> None:
        for memory in (self._seals, self._layer_seals):
            if memory is not None and memory.allocated:
                await self.run_blocking(memory.close)

    def _settle(self, emit: Emit, record: StoreObject, code: int) -> None:
        """Report what became of one record, in its own job."""
        if code == Code.OK:
            self._reporter.stored(emit, record)
        elif code == Code.ALREADY_EXISTS:  # someone stored it first: the object is there
            self._reporter.existing(emit, record)
        elif code == STEP_CALLED_OFF:
            message = f"put {record.key}: the step that computed it failed before it was visible: revoked"
            self._reporter.failed(emit, record, message, FailReason.CALLED_OFF)
        else:
            no_space = code == Code.NO_SPACE
            if no_space:
                emit.count("backpressure")
            reason = FailReason.NO_SPACE if no_space else FailReason.STORE_ERROR
            self._reporter.failed(emit, record, f"put {record.key}: {describe(code)}", reason)


def _answers(results: Sequence[int], expected: int) -> Sequence[int]:
    """A store call's per-key results, checked to be one per key (raises RuntimeError otherwise)."""
    if len(results) != expected:
        raise RuntimeError(f"store answered {len(results)} results for {expected} keys")
    return results
