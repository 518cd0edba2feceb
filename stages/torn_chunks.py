"""Torn chunks: a chunk is stored whole or not at all, under group semantics.

A chunk is reusable only whole (every store group and shard of its prefix), and
with group ids the store evicts it whole. When a put call stores some objects of a
chunk and the store refuses others, the chunk is *torn*: the put stage removes its
stored objects again (:meth:`TornChunks.remove_torn`; their records fail with
:data:`ROLLED_BACK`) rather than hold memory no reader can use.

Two things keep a rollback from tearing what another put counts on:

- *claims* (:meth:`TornChunks.claim`): two batches never put one chunk at once, so
  one's rollback cannot remove objects the other counts as stored;
- *the memory of rolled-back chunks* (:data:`TORN_MEMORY_S`): the filter may have
  answered "stored" for some objects of a chunk just before a rollback removed
  them; a later batch that puts only the rest of that chunk asks for the removed
  ones first, and fails the rest (:data:`TORN_BEFORE`) unless they are back
  (:meth:`TornChunks.fail_torn`).

The :class:`TornChunks` of a put stage is used from its event loop only (no lock);
the store calls it makes are the stage's, passed in.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import anyio

from kvpipe.pipeline.stage import Emit

from .batch_calls import StoreCallError
from .model import StoreObject
from .object_status import FailReason, ObjectReporter
from .store import EXISTS, Code

ROLLED_BACK = "removed again: another object of its chunk was refused"
TORN_BEFORE = "not put: another object of its chunk was removed again after a refusal"
#: How long a rolled-back chunk is remembered: longer than a record spends between the
#: filter's answer and its put (the queues between them hold milliseconds of work).
TORN_MEMORY_S = 30.0

#: a store call made in the put stage's worker thread: per key an answer, or StoreCallError
KeyCall = Callable[[list[str]], Awaitable[list[int]]]


def claim_unit(record: StoreObject) -> str:
    """What two batches must not put at once: a record's chunk (under group semantics), or its key."""
    return record.group_id or record.key


class TornChunks:
    """The put stage's claims on the chunks it puts, and its memory of the chunks it rolled back.

    ``exist``: per key :data:`~.store.EXISTS` or not (``batch_is_exist``);
    ``remove``: per key 0 or negative (a forced remove: a lookup leases a hot
    chunk's objects). Both raise StoreCallError when the store gives no usable
    answer. ``reporter``: where the records of a chunk torn before are failed.
    """

    def __init__(self, exist: KeyCall, remove: KeyCall, reporter: ObjectReporter) -> None:
        self._exist = exist
        self._remove = remove
        self._reporter = reporter
        #: chunk (group id, else key) -> set when the batch putting it is done (see :meth:`claim`)
        self._in_flight: dict[str, anyio.Event] = {}
        #: group id -> when this stage rolled its chunk back, and the keys it removed (see :meth:`fail_torn`)
        self._torn: dict[str, tuple[float, frozenset[str]]] = {}

    async def claim(self, units: set[str]) -> anyio.Event:
        """Wait until no other batch is putting any of ``units``, then mark them in flight; the batch's event.

        The filter asks the store in batches, so a chunk can be answered absent to
        the next batch while this stage's other worker is still putting it. Two puts
        of one chunk must not overlap: under group semantics one's rollback of a torn
        chunk would remove objects the other counts as stored. A batch that holds
        units never waits (it claims all of its units at once, between two awaits),
        so two batches cannot wait on each other. The batch gives them back with
        :meth:`release`, whatever became of its puts.
        """
        while busy := next((self._in_flight[unit] for unit in units if unit in self._in_flight), None):
            await busy.wait()
        done = anyio.Event()
        for unit in units:
            self._in_flight[unit] = done
        return done

    def release(self, units: set[str], done: anyio.Event) -> None:
        """The batch that :meth:`claim` ed ``units`` (and got ``done``) is done with them."""
        for unit in units:
            del self._in_flight[unit]
        done.set()

    async def fail_torn(self, holders: dict[str, list[tuple[Emit, StoreObject]]]) -> None:
        """Fail (and drop from ``holders``) the records of chunks whose objects this stage removed since.

        ``holders``: the batch's records by key (the put stage's ``Holders``).
        The filter may have answered "stored" for some objects of a chunk just
        before another batch rolled that chunk back (:meth:`remove_torn`):
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
            present = dict(zip(keys, await self._exist(keys), strict=True))
            broken = {g for g, missing in to_ask.items() if any(present[k] != EXISTS for k in missing)}
        except StoreCallError:
            broken = set(to_ask)
        for key in [key for key, holding in holders.items() if holding[0][1].group_id in broken]:
            for emit, held in holders.pop(key):
                self._reporter.failed(emit, held, f"put {held.key}: {TORN_BEFORE}", FailReason.ROLLED_BACK)

    async def remove_torn(self, call: Sequence[StoreObject], codes: list[int]) -> set[str]:
        """Under group semantics, undo the puts of a chunk whose other objects were refused.

        A chunk is reusable only whole (every stored group and shard), and with
        group ids the store evicts it whole; an object stored beside a refused
        sibling would only hold memory no reader can use. Its siblings sit in this
        same call (:func:`~.batch_calls.split_into_calls` keeps a chunk together),
        so the call's answers say whether the chunk is torn. Returns the keys removed.
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
            results = await self._remove(torn)
        except StoreCallError:
            return set()  # they stay stored: reported as put, the chunk partial
        removed = {key for key, result in zip(torn, results, strict=True) if result == Code.OK}
        when = time.monotonic()
        for record in call:
            if record.key in removed and record.group_id:
                _, keys = self._torn.pop(record.group_id, (when, frozenset()))
                self._torn[record.group_id] = (when, keys | {record.key})  # last: newest
        return removed
