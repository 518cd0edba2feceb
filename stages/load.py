"""The ``load`` stage: copy stored chunks back into the engine's blocks (the load path's end).

A load request names a token range the lookup found stored and the blocks the
engine allocated for it. Each chunk of the range (as :mod:`.load_plan` plans it)
becomes one record per storable group and shard, exactly as the save path named
it, with the buffers of the block it lands in; all records of a batch go to the
store in as few ``batch_get_into_multi_buffers`` calls as the buffer budget allows.

A record is loaded only when the store read exactly the object's size into it
and, with ``integrity`` on, its seal vouches for the bytes read (:mod:`.integrity`:
the seal is read in the same call, into a registered :class:`~.seal.SealMemory`).
An object its seal shows damaged is removed from the store (forced: a hot chunk's
objects are leased by every lookup) and logged once per chunk; one written under
another configuration's fingerprint is left to its writer. Anything else (a missing object, a destination of the wrong size, an error) is
a failed load, never a partial success: the engine must not compute on half a
block. Failed records are counted against the request's job and their block ids
are told to the optional :class:`LoadObserver`, because the engine recomputes
from the first block that did not load (vLLM's ``get_block_ids_with_load_errors``).
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import anyio
import structlog
from pydantic import BaseModel, ConfigDict, Field

from kvpipe.pipeline.stage import BatchEntry, BatchStage, Emit

from .batch_calls import (
    MAX_BUFFERS_PER_CALL,
    StoreCallError,
    call_per_key,
    remove_each,
    sizes_of,
    split_into_calls,
)
from .integrity import (
    REFUSED,
    SEAL_SIZE,
    Integrity,
    Verdict,
    fingerprint,
    judge,
    key_stem,
    seal_candidates,
    seal_key,
)
from .keys import is_layer_seal_key, is_seal_key, layer_seal_key, object_key, sealed_key
from .layer_seals import LayerEntry, layer_seal_size, wave_intact
from .layer_seals import unpack as unpack_layer_seal
from .layers import GetSessions, common_waves, wave_pieces
from .load_plan import LoadRequest, load_chunks, touched_block_ids
from .model import KVCache, Shard, StoreGroup, StoreObject, hot_record, spans
from .object_status import DEADLINE_PASSED
from .retention import LoadedKeys
from .seal import SealMemory
from .storable import storable_groups
from .store import EXISTS, Code, LoadingStore, describe
from .vouching import DAMAGED, SealPlace, Vouchers, Witness, size_unknown

log = structlog.get_logger(__name__)

#: how many chunks' integrity failures are remembered as logged (each is logged once)
LOGGED_CHUNKS = 4096

_WHY = {
    Verdict.CORRUPT: "its bytes are not those its seal describes (damaged or overwritten); removed",
    Verdict.FOREIGN: (
        "written by an engine of another configuration (dtype, layout, block size or revision) "
        "under the same key; give each configuration its own cache_prefix"
    ),
    Verdict.UNSEALED: "it has no seal and integrity is 'required'",
}


class LoadParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_buffers_per_call: int = Field(MAX_BUFFERS_PER_CALL, gt=0)
    integrity: Integrity = Integrity.VERIFY


@runtime_checkable
class LoadObserver(Protocol):
    """Told once per load request which of its blocks failed to load (often none).

    Told the request object as submitted, so a caller that gave a load up can tell
    its late answer from a later load of the same request id. Runs on the
    pipeline's loop thread: it must be quick.
    """

    def __call__(self, request: LoadRequest, failed_block_ids: frozenset[int]) -> None: ...


@runtime_checkable
class LayerObserver(Protocol):
    """Told, for a layered load request, that wave ``wave`` of its objects has landed (or failed).

    Told once per wave, in order, once that wave's ranged gets have returned; a
    record that failed is settled as failed when the request's job ends. Runs on
    the pipeline's loop thread: it must be quick.
    """

    def __call__(self, request: LoadRequest, wave: int) -> None: ...


@hot_record
class LoadTarget:
    """One object to read and the engine block it lands in."""

    record: StoreObject
    block_id: int


def load_targets(
    groups: Sequence[StoreGroup], shards: Sequence[Shard], hash_block_size: int, request: LoadRequest
) -> tuple[LoadTarget, ...]:
    """One target per chunk of :func:`load_chunks` per shard (raises as it does)."""
    return tuple(
        LoadTarget(
            StoreObject(
                key=object_key(shard.namespace, chunk.group.store_group, chunk.chunk_hash),
                chunk_hash=chunk.chunk_hash,
                store_group=chunk.group.store_group,
                buffers=shard.layouts[chunk.group.engine_group].buffers(chunk.block_id),
                request_id=request.request_id,
                chunk_index=chunk.block_index,
            ),
            chunk.block_id,
        )
        for chunk in load_chunks(groups, hash_block_size, request)
        for shard in shards
    )


@dataclass(slots=True)
class _Pending:
    """One entry of the batch while its records are out: its handle and what became of each.

    Outcomes are held until the batch's calls are done, so the observer hears of
    a request's failed blocks before any of its records settles: a caller that
    sees the job complete has always been told already.
    """

    emit: Emit
    request: LoadRequest
    failed_block_ids: set[int] = field(default_factory=set)
    loaded: int = 0
    verdicts: Counter[Verdict] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    rejected: str | None = None  # the request itself is invalid: nothing of it was sent

    def settle(self) -> None:
        if self.rejected is not None:
            self.emit.fail(self.rejected)
            return
        if not self.loaded and not self.failures:
            self.emit.drop("no chunk to load")
            return
        for _ in range(self.loaded):
            self.emit.count("loaded")
            self.emit.succeed()
        for verdict, count in self.verdicts.items():
            self.emit.count(f"integrity_{verdict.value}", count)
        for message in self.failures:
            self.emit.count("failed")
            self.emit.fail(message)


class LoadStage(BatchStage):
    """LoadRequest -> bytes in the engine's blocks. A sink: it reports per record.

    Each loaded record counts ``loaded`` and succeeds; each failed one counts
    ``failed``, fails its job with the key and the reason, and adds its block id
    to what the observer is told for that request. With ``integrity`` on, each
    object read whole also counts ``integrity_<verdict>`` (:class:`~.integrity.Verdict`).
    """

    ports: ClassVar[tuple[str, ...]] = ()
    input_type: ClassVar[Any] = LoadRequest

    def __init__(
        self,
        params: LoadParams,
        kv: KVCache,
        store: LoadingStore,
        observer: LoadObserver | None = None,
        loads: LoadedKeys | None = None,
        layer_observer: LayerObserver | None = None,
    ) -> None:
        """``loads`` is told the key of every object loaded (retention counts them as requests);
        ``layer_observer``, each wave of a layered load as it lands."""
        self._loads = loads
        self._layer_observer = layer_observer
        self._waves = kv.layer_waves
        self._sessions = GetSessions()
        self._groups = storable_groups(kv)
        self._block_size = {group.store_group: group.spec.block_size for group in self._groups}
        self._engine_group = {group.store_group: group.engine_group for group in self._groups}
        self._shards = kv.shards
        self._hash_block_size = kv.hash_block_size
        self._store = store
        self._observer = observer
        self._max_buffers = params.max_buffers_per_call
        self._integrity = params.integrity
        self._seal_buffers = 0 if params.integrity is Integrity.OFF else 1  # a seal is read beside each object
        self._fingerprint = fingerprint(kv)
        self._seals = SealMemory(store, params.max_buffers_per_call)
        self._common_waves = common_waves(kv)
        self._layer_seals = (
            SealMemory(store, params.max_buffers_per_call, slot_bytes=layer_seal_size(len(self._common_waves)))
            if self._common_waves and params.integrity is not Integrity.OFF
            else None
        )
        self._logged: OrderedDict[bytes, None] = OrderedDict()  # chunks whose failure was logged

    async def process_batch(self, batch: Sequence[BatchEntry[LoadRequest]]) -> None:
        pending = [_Pending(entry.emit, entry.item) for entry in batch]
        sendable: list[tuple[_Pending, LoadTarget]] = []
        layered: list[tuple[_Pending, LoadTarget]] = []
        for holder in pending:
            try:
                targets = load_targets(self._groups, self._shards, self._hash_block_size, holder.request)
            except ValueError as error:
                holder.rejected = str(error)
                holder.failed_block_ids.update(touched_block_ids(self._groups, holder.request))
                continue
            for target in targets:
                if holder.emit.expired:  # its blocks are recomputed: a miss, not a late load
                    self._failed(holder, target, f"load {target.record.key}: {DEADLINE_PASSED}")
                elif len(target.record.buffers) + self._seal_buffers > self._max_buffers:
                    self._failed(
                        holder,
                        target,
                        f"load {target.record.key}: {len(target.record.buffers) + self._seal_buffers} buffers exceed "
                        f"max_buffers_per_call={self._max_buffers}; not sent",
                    )
                elif holder.request.layered and self._waves.get(self._engine_group[target.record.store_group]):
                    layered.append((holder, target))
                else:
                    sendable.append((holder, target))
        for call in self._calls(sendable):
            await self._load(call)
        if layered:
            await self._load_layered(layered)
        for holder in pending:
            if self._observer is not None:
                self._observer(holder.request, frozenset(holder.failed_block_ids))
            holder.settle()

    def _calls(self, sendable: list[tuple[_Pending, LoadTarget]]) -> list[list[tuple[_Pending, LoadTarget]]]:
        """Calls within the buffer budget, each key at most once per call.

        Two requests of a batch may load the same chunk into different blocks;
        such a repeat goes to a later round of calls rather than trusting the
        store with one key twice in a call.
        """
        rounds: list[dict[str, tuple[_Pending, LoadTarget]]] = []
        for pair in sendable:
            key = pair[1].record.key
            free = next((r for r in rounds if key not in r), None)
            if free is None:
                rounds.append(free := {})
            free[key] = pair
        calls = []
        for round_ in rounds:
            by_record = {id(target.record): (holder, target) for holder, target in round_.values()}
            records = [target.record for _, target in round_.values()]
            for call in split_into_calls(records, self._max_buffers, self._seal_buffers):
                calls.append([by_record[id(record)] for record in call])
        return calls

    async def _load_layered(self, sendable: list[tuple[_Pending, LoadTarget]]) -> None:
        """Read ``sendable``'s objects wave by wave (one ranged get per call and wave), then judge and settle them.

        Every object is in a get session while its waves are read (:class:`~.layers.GetSessions`).
        With integrity on, the seals and layer seals that may vouch for the objects are
        read first (:mod:`.layer_seals`): an object a layer seal vouches for is
        checked wave by wave, each wave before the requests hear of it, so no layer
        reaches the engine's attention unchecked; one sealed without a layer seal
        is read whole and judged before the first wave (as a whole load would).
        After each wave the layered requests hear of it; at the end every object
        read is judged whole, as whole loads are, and settled.
        """
        calls = self._calls(sendable)
        keys = list(dict.fromkeys(target.record.key for _, target in sendable))
        read: dict[int, int | None] = {id(target.record): 0 for _, target in sendable}  # None: failed, told
        fresh = self._sessions.to_open(keys)
        try:
            started = await call_per_key(self, self._store.batch_get_session_start, fresh) if fresh else []
        except StoreCallError as error:
            started = [Code.RPC_FAILED] * len(fresh)
            log.warning("get sessions could not start", keys=len(fresh), error=str(error))
        refused = {key: code for key, code in zip(fresh, started, strict=True) if code != Code.OK}
        for _, target in sendable:
            if (code := refused.get(target.record.key)) is not None:
                read[id(target.record)] = code
        opened = [key for key in keys if key not in refused]
        self._sessions.joined(opened)
        waves = max(len(self._waves[self._engine_group[t.record.store_group]]) for _, t in sendable)
        requests = list({id(holder): holder.request for holder, _ in sendable}.values())
        witnesses: dict[int, Witness] = {}
        checks: dict[int, LayerEntry] = {}  # id(record) -> its layer seal's entry: checked wave by wave
        damaged: set[str] = set()
        try:
            if self._integrity is not Integrity.OFF:
                await self._vouched(calls, read, witnesses, checks)
            for wave in range(waves):
                for call in calls:
                    await self._read_wave(call, wave, read)
                    if checks:
                        damaged |= await self._checked_wave(call, wave, read, witnesses, checks)
                if self._layer_observer is not None:
                    for request in requests:
                        self._layer_observer(request, wave)
        finally:
            if closing := self._sessions.left(opened):
                try:
                    await self.run_blocking(self._store.batch_get_session_end, closing)
                except Exception as error:  # noqa: BLE001 - a store outside our control: the reads are done
                    log.warning("get sessions could not end", keys=len(closing), error=str(error))
        for call in calls:
            live = [(holder, target) for holder, target in call if read[id(target.record)] is not None]
            if live:
                # an object whose session never opened read nothing: it fails whatever its seals say
                known = [witnesses.get(id(target.record), Witness(None)) for _, target in live] if witnesses else None
                await self._load(live, [read[id(target.record)] or 0 for _, target in live], known, checks.keys())
        if damaged:
            await self._remove_damaged(damaged)

    async def _vouched(
        self,
        calls: list[list[tuple[_Pending, LoadTarget]]],
        read: dict[int, int | None],
        witnesses: dict[int, Witness],
        checks: dict[int, LayerEntry],
    ) -> None:
        """Before the first wave: what the seals say of each object still to read, into ``witnesses`` and ``checks``.

        An object vouched for by a seal of this configuration whose layer seal
        names the same bytes is checked wave by wave (``checks``); one vouched for
        otherwise, whose seal could not be read, or (``integrity: required``) that
        no seal vouches for, is read whole and judged now, before the forward, and
        left out of the waves (``read`` None). One no seal vouches for is read layer
        by layer unverified, as a whole load would load it.
        """
        whole: list[tuple[_Pending, LoadTarget]] = []
        for call in calls:
            live = [(holder, target) for holder, target in call if read[id(target.record)] == 0]
            if not live:
                continue
            try:
                found = await self._read_layer_seals(live)
            except StoreCallError as error:
                for holder, target in live:
                    self._failed(holder, target, f"load {target.record.key}: {error}")
                    read[id(target.record)] = None
                continue
            for (holder, target), (witness, entry) in zip(live, found, strict=True):
                witnesses[id(target.record)] = witness
                if entry is not None:
                    checks[id(target.record)] = entry
                elif witness.vouch is not None or witness.problem is not None or self._integrity is Integrity.REQUIRED:
                    whole.append((holder, target))
                    read[id(target.record)] = None  # settled by its whole load, now
        for call in self._calls(whole):
            await self._load(call)

    async def _read_layer_seals(
        self, call: list[tuple[_Pending, LoadTarget]]
    ) -> list[tuple[Witness, LayerEntry | None]]:
        """Read the seals and layer seals that may vouch for ``call``'s objects: each one's witness, and the
        layer seal entry that names its bytes (one of this configuration, bound to the vouching entry).

        Raises :class:`~.batch_calls.StoreCallError` for a store call that failed.
        """
        places = self._seal_places(call)
        layer_places = {layer_seal_key(sealed_key(key)): place for key, place in places.items()}
        readable = (await self._readable_seals({**places, **layer_places}))[: self._max_buffers]
        seals = [(key, place) for key, place in readable if is_seal_key(key)]
        layer_seals = [(key, place) for key, place in readable if is_layer_seal_key(key)]
        waves = len(self._common_waves)
        layer_size = layer_seal_size(waves)
        slab = await self._seals.acquire(self)
        assert self._layer_seals is not None  # a stage with waves and integrity on has layer seal memory
        layer_slab = await self._layer_seals.acquire(self)
        try:
            keys = [key for key, _ in seals] + [key for key, _ in layer_seals]
            ptrs = [[slab.address(slot)] for slot in range(len(seals))]
            ptrs += [[layer_slab.address(slot)] for slot in range(len(layer_seals))]
            sizes = [[SEAL_SIZE]] * len(seals) + [[layer_size]] * len(layer_seals)
            results = await call_per_key(self, self._store.batch_get_into_multi_buffers, keys, ptrs, sizes) if keys else []
            stored = await self._stored_sizes(
                [key for (key, _), result in zip(seals, results, strict=False) if size_unknown(result)]
            )
            vouchers = Vouchers()
            for slot, ((key, place), result) in enumerate(zip(seals, results, strict=False)):
                vouchers.add(key, place, result, slab.read(slot) if result == SEAL_SIZE else None, stored.get(key))
            by_seal: dict[str, dict[int, LayerEntry]] = {}
            for slot, ((key, _), result) in enumerate(zip(layer_seals, results[len(seals) :], strict=True)):
                entries = unpack_layer_seal(layer_slab.read(slot), waves) if result == layer_size else None
                if entries is not None:
                    by_seal[seal_key(sealed_key(key))] = entries
        finally:
            slab.release()
            layer_slab.release()
        found: list[tuple[Witness, LayerEntry | None]] = []
        for _, target in call:
            witness = vouchers.witness(target.record)
            entry = None
            vouch = witness.vouch
            if vouch is not None and witness.seal is not None and vouch.fingerprint == self._fingerprint:
                named = by_seal.get(witness.seal, {}).get(vouch.entry.key_id)
                if named is not None and named.checksum == vouch.entry.checksum:
                    entry = named
            found.append((witness, entry))
        return found

    async def _checked_wave(
        self,
        call: list[tuple[_Pending, LoadTarget]],
        wave: int,
        read: dict[int, int | None],
        witnesses: dict[int, Witness],
        checks: dict[int, LayerEntry],
    ) -> set[str]:
        """Check wave ``wave`` of ``call``'s objects that layer seals vouch for; fail those whose bytes differ.

        A failed one is refused as corrupt (its block fails, before its layer is
        told); the keys returned go from the store with it (:meth:`_doomed`).
        """
        checking = [
            (holder, target, checks[id(target.record)])
            for holder, target in call
            if id(target.record) in checks and (so_far := read[id(target.record)]) is not None and so_far >= 0
        ]
        if not checking:
            return set()
        ranges = [self._waves[self._engine_group[target.record.store_group]][wave] for _, target, _ in checking]
        intact = [False] * len(checking)

        def check(start: int, end: int) -> None:
            for index in range(start, end):
                _, target, entry = checking[index]
                intact[index] = not ranges[index] or wave_intact(entry, wave, target.record.buffers, ranges[index])

        async with anyio.create_task_group() as group:  # xxh3 lets go of the GIL: a share per worker thread
            for start, end in _shares(len(checking), self.thread_limit):
                group.start_soon(self.run_blocking, check, start, end)
        damaged: set[str] = set()
        for (holder, target, _), ok in zip(checking, intact, strict=True):
            if ok:
                continue
            holder.verdicts[Verdict.CORRUPT] += 1
            self._refused(holder, target, Verdict.CORRUPT, f"layer {wave}")
            read[id(target.record)] = None
            damaged.update(self._doomed(target.record, witnesses[id(target.record)]))
        return damaged

    async def _remove_damaged(self, damaged: set[str]) -> None:
        try:  # forced: every lookup leases a hot chunk's objects
            await call_per_key(self, remove_each, sorted(damaged), self._store, True)
        except StoreCallError as error:
            log.warning("removing damaged objects failed", keys=sorted(damaged), error=str(error))

    async def _read_wave(self, call: list[tuple[_Pending, LoadTarget]], wave: int, read: dict[int, int | None]) -> None:
        """One ranged get of wave ``wave`` of ``call``'s objects still whole so far; their bytes or codes into ``read``."""
        keys: list[str] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        offsets: list[list[int]] = []
        reading: list[tuple[_Pending, LoadTarget]] = []
        for holder, target in call:
            record = target.record
            if (so_far := read[id(record)]) is None or so_far < 0:
                continue
            if holder.emit.expired:  # its blocks are recomputed: a miss, not a late load
                self._failed(holder, target, f"load {record.key}: {DEADLINE_PASSED}")
                read[id(record)] = None
                continue
            waves = self._waves[self._engine_group[record.store_group]]
            if wave >= len(waves) or not waves[wave]:
                continue
            piece_ptrs, piece_sizes, piece_offsets = wave_pieces(record.buffers, waves[wave])
            keys.append(record.key)
            ptrs.append(piece_ptrs)
            sizes.append(piece_sizes)
            offsets.append(piece_offsets)
            reading.append((holder, target))
        if not keys:
            return
        # one call, in one worker thread: a call that hangs (a node cut off) leaves the other to other loads
        try:
            codes = await call_per_key(
                self, self._store.batch_get_into_multi_buffer_ranges, keys, ptrs, sizes, offsets
            )
        except StoreCallError as error:
            for holder, target in reading:
                self._failed(holder, target, f"load {target.record.key}: {error}")
                read[id(target.record)] = None
            return
        for (_, target), code in zip(reading, codes, strict=True):
            so_far = read[id(target.record)]
            assert so_far is not None  # only records still whole were read
            read[id(target.record)] = code if code < 0 else so_far + code

    async def _load(
        self,
        call: list[tuple[_Pending, LoadTarget]],
        read: list[int] | None = None,
        known: list[Witness] | None = None,
        checked: Collection[int] = (),
    ) -> None:
        """One store call (the objects and, with integrity on, the seals that may vouch for them); settle each record.

        ``read``: the objects were read already (layer by layer), each's bytes or
        code: the call reads only the seals, if any; ``known``: what the seals say of
        each object, read already (then no seal is read); ``checked``: the ids of the
        records whose every wave its layer seal vouched for (verified, not hashed again).
        """
        records = [target.record for _, target in call]
        keys: list[str] = []
        ptrs: list[Sequence[int]] = []
        sizes: list[Sequence[int]] = []
        if read is None:
            keys = [record.key for record in records]
            ptrs, sizes = (list(column) for column in zip(*(spans(record.buffers) for record in records), strict=True))
        slab = None if self._integrity is Integrity.OFF or known is not None else await self._seals.acquire(self)
        try:
            readable: list[tuple[str, SealPlace]] = []
            if slab is not None:
                room = self._max_buffers - sum(map(len, ptrs))
                readable = (await self._readable_seals(self._seal_places(call)))[:room]
                for slot, (key, _) in enumerate(readable):
                    keys.append(key)
                    ptrs.append([slab.address(slot)])
                    sizes.append([SEAL_SIZE])
            try:
                got = await call_per_key(self, self._store.batch_get_into_multi_buffers, keys, ptrs, sizes) if keys else []
            except StoreCallError as error:
                for holder, target in call:
                    self._failed(holder, target, f"load {target.record.key}: {error}")
                return
            results = got if read is None else [*read, *got]
            witnesses: list[Witness] = known or []
            verdicts: list[Verdict | None] = [None] * len(records)
            if known is not None:
                verdicts = await self._judged_unless_checked(records, results, known, checked)
            if slab is not None:
                vouchers = Vouchers()
                seal_results = results[len(records) :]
                stored = await self._stored_sizes(
                    [key for (key, _), result in zip(readable, seal_results, strict=True) if size_unknown(result)]
                )
                for slot, ((key, place), result) in enumerate(zip(readable, seal_results, strict=True)):
                    data = slab.read(slot) if result == SEAL_SIZE else None
                    vouchers.add(key, place, result, data, stored.get(key))
                witnesses = [vouchers.witness(record) for record in records]
                verdicts = await self._judged(records, results, witnesses)
        finally:
            if slab is not None:
                slab.release()
        damaged: set[str] = set()
        loaded: list[str] = []
        for index, ((holder, target), result, verdict) in enumerate(zip(call, results, verdicts, strict=False)):
            expected = target.record.size
            if result != expected:
                reason = describe(result) if result < 0 else f"read {result} bytes, the block holds {expected}"
                self._failed(holder, target, f"load {target.record.key}: {reason}")
                continue
            if witnesses and (problem := witnesses[index].problem) not in (None, DAMAGED):
                # a seal that may vouch for it could not be read now: nothing is known of the bytes
                self._failed(holder, target, f"load {target.record.key}: a seal: {problem}")
                continue
            if verdict is not None:
                holder.verdicts[verdict] += 1
                if verdict in REFUSED:
                    self._refused(holder, target, verdict)
                    if verdict is Verdict.CORRUPT:
                        damaged.update(self._doomed(target.record, witnesses[index]))
                    continue
            holder.loaded += 1
            loaded.append(target.record.key)
        if self._loads is not None:
            self._loads.loaded(loaded)
        if damaged:
            await self._remove_damaged(damaged)

    async def _stored_sizes(self, seals: list[str]) -> dict[str, int]:
        """The stored sizes of ``seals`` (reads that failed as a transfer: a seal of another, smaller size?)."""
        if not seals:
            return {}
        try:
            return dict(zip(seals, await call_per_key(self, sizes_of, seals, self._store), strict=True))
        except StoreCallError:
            return {}

    @staticmethod
    def _doomed(record: StoreObject, witness: Witness) -> list[str]:
        """What goes from the store with an object found corrupt: the object, and its seal where that is suspect.

        A damaged seal goes. So does the object's own seal (it anchored its span):
        the object put again will be anchored there again, and a put of a key that
        exists keeps the old seal, which may be another writer's (the race in
        :mod:`.integrity`'s docs) and would refuse every recompute. A seal anchored
        before it stays: it vouches for its other objects, and the object put again
        gets a seal of its own, nearer, which wins (:meth:`~.vouching.Vouchers.vouch_for`).
        """
        seal = witness.seal
        if seal is not None and (witness.problem == DAMAGED or seal == seal_key(record.key)):
            return [record.key, seal, layer_seal_key(sealed_key(seal))]  # the layer seal goes with its seal
        return [record.key]

    def _seal_places(self, call: Sequence[tuple[_Pending, LoadTarget]]) -> dict[str, SealPlace]:
        """The keys of the seals that may vouch for ``call``'s objects, each with its place; the objects' own first.

        A load reads a run of chunks per stream, so beyond the objects' own seal
        keys only the earliest object of each stream and request looks further
        back (:func:`~.integrity.seal_candidates`).
        """
        places: dict[str, SealPlace] = {}
        earliest: dict[tuple[int, str], tuple[_Pending, StoreObject]] = {}
        for holder, target in call:
            record = target.record
            stem = key_stem(record.key, record.chunk_hash)
            places[seal_key(record.key)] = SealPlace(stem, record.chunk_index)
            stream = (id(holder), stem)
            first = earliest.get(stream)
            if first is None or record.chunk_index < first[1].chunk_index:
                earliest[stream] = (holder, record)
        for holder, record in earliest.values():
            candidates = seal_candidates(
                record.key,
                record.chunk_hash,
                record.chunk_index,
                self._block_size[record.store_group],
                holder.request.block_hashes,
                self._hash_block_size,
            )
            stem = key_stem(record.key, record.chunk_hash)
            for back, key in enumerate(candidates[1:], start=1):
                places.setdefault(key, SealPlace(stem, record.chunk_index - back))
        return places

    async def _readable_seals(self, places: dict[str, SealPlace]) -> list[tuple[str, SealPlace]]:
        """The seals of ``places`` the store says it can give, asked before reading any.

        ``batch_is_exist`` answers 0 for an object with a replica on a node that no
        longer answers (the lookups' every-copy rule), and a read of such a replica
        waits for the kernel to give up its connection (tens of seconds). The data
        passed that rule at lookup; its seals must too. A seal not read is a missing one.
        """
        keys = list(places)
        try:
            present = await call_per_key(self, self._store.batch_is_exist, keys)
        except StoreCallError:
            return []
        return [(key, places[key]) for key, answer in zip(keys, present, strict=True) if answer == EXISTS]

    async def _judged_unless_checked(
        self,
        records: Sequence[StoreObject],
        results: Sequence[int],
        witnesses: Sequence[Witness],
        checked: Collection[int],
    ) -> list[Verdict | None]:
        """:meth:`_judged`, but an object read whole whose every wave was checked (its id in ``checked``) is verified."""
        verdicts: list[Verdict | None] = [None] * len(records)
        judging = []
        for index, (record, result) in enumerate(zip(records, results, strict=True)):
            if id(record) not in checked:
                judging.append(index)
            elif result == record.size:
                verdicts[index] = Verdict.VERIFIED
        judged = await self._judged(
            [records[i] for i in judging], [results[i] for i in judging], [witnesses[i] for i in judging]
        )
        for index, verdict in zip(judging, judged, strict=True):
            verdicts[index] = verdict
        return verdicts

    async def _judged(
        self, records: Sequence[StoreObject], results: Sequence[int], witnesses: Sequence[Witness]
    ) -> list[Verdict | None]:
        """Each object's verdict, judged in as many worker threads as the stage has.

        xxh3 lets go of the GIL, and a sync load's engine waits for the verdicts:
        two threads halve that wait on two idle cores.
        """
        verdicts: list[Verdict | None] = [None] * len(records)

        async def judge(start: int, end: int) -> None:
            verdicts[start:end] = await self.run_blocking(self._judge_range, records, results, witnesses, start, end)

        async with anyio.create_task_group() as group:
            for start, end in _shares(len(records), self.thread_limit):
                group.start_soon(judge, start, end)
        return verdicts

    def _judge_range(
        self,
        records: Sequence[StoreObject],
        results: Sequence[int],
        witnesses: Sequence[Witness],
        start: int,
        end: int,
    ) -> list[Verdict | None]:
        """The verdicts of ``records[start:end]``, in a worker thread; None where an object was not read whole."""
        verdicts: list[Verdict | None] = []
        for index in range(start, end):
            record = records[index]
            if results[index] != record.size:
                verdicts.append(None)
                continue
            witness = witnesses[index]
            addresses, sizes = spans(record.buffers)
            verdicts.append(
                judge(
                    witness.vouch,
                    addresses,
                    sizes,
                    self._fingerprint,
                    self._integrity,
                    damaged_seal=witness.problem == DAMAGED,
                )
            )
        return verdicts

    def _refused(self, holder: _Pending, target: LoadTarget, verdict: Verdict, where: str = "") -> None:
        """A block whose bytes must not be used: failed, and the chunk's first such failure logged.

        ``where``: the part of the object found so (a layer), if not the whole.
        """
        record = target.record
        self._failed(holder, target, f"load {record.key}: integrity: {verdict.value}{f' ({where})' if where else ''}")
        if record.chunk_hash in self._logged:
            return
        self._logged[record.chunk_hash] = None
        if len(self._logged) > LOGGED_CHUNKS:
            self._logged.popitem(last=False)
        log.warning(
            "integrity check refused a stored object",
            key=record.key,
            verdict=verdict.value,
            why=_WHY[verdict],
        )

    async def stop(self) -> None:
        for memory in (self._seals, self._layer_seals):
            if memory is not None and memory.allocated:
                await self.run_blocking(memory.close)

    def _failed(self, holder: _Pending, target: LoadTarget, message: str) -> None:
        holder.failures.append(message)
        holder.failed_block_ids.add(target.block_id)


def _shares(count: int, parts: int) -> list[tuple[int, int]]:
    """``range(count)`` cut into at most ``parts`` runs of near-equal length, as ``(start, end)`` pairs."""
    parts = max(1, min(parts, count))
    return list(itertools.pairwise(count * part // parts for part in range(parts + 1)))
