"""The ``filter`` stage: skip objects the store already has.

Shared by both paths and batched across requests: one ``batch_is_exist`` answers
for every record of the batch, because each store call costs a round trip and a
GIL hand-back, while the answer for 2048 keys costs about a millisecond. An error
code is "don't know", never "absent": such a record fails rather than being put
blindly over a store that is in trouble. A request whose job is past its
deadline is not asked about: its records fail at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvpipe.pipeline.stage import BatchEntry, BatchStage

from .batch_calls import StoreCallError, call_per_key
from .model import Records
from .object_status import FailReason, ObjectObserver, ObjectReporter
from .store import EXISTS, SavingStore, describe

ABSENT = 0


class FilterStage(BatchStage):
    """Records -> the records the store does not have yet (one tuple per entry), or a drop."""

    input_type: ClassVar[Any] = Records
    output_types: ClassVar[dict[str, Any]] = {"out": Records}

    def __init__(self, store: SavingStore, observer: ObjectObserver | None = None) -> None:
        self._store = store
        self._reporter = ObjectReporter(observer)

    async def process_batch(self, batch: Sequence[BatchEntry[Records]]) -> None:
        batch = self._reporter.fail_expired(batch, "exist")
        # Requests sharing a prefix share keys: each key is asked once.
        keys = list(dict.fromkeys(record.key for entry in batch for record in entry.item))
        answers: dict[str, int] = {}
        call_error: StoreCallError | None = None
        if keys:
            try:
                answers = dict(
                    zip(keys, await call_per_key(self, self._store.batch_is_exist, keys), strict=True)
                )
            except StoreCallError as error:
                call_error = error
        claimed: set[str] = set()  # absent keys an earlier entry of this batch puts
        for entry in batch:
            emit = entry.emit
            missing = []
            existing = []
            for record in entry.item:
                if call_error is not None:
                    self._reporter.failed(
                        emit, record, f"exist {record.key}: {call_error}", FailReason.STORE_ERROR
                    )
                elif (answer := answers[record.key]) == EXISTS or record.key in claimed:
                    # Put once: two puts of one chunk race in the put stage's workers, and
                    # under group semantics one's rollback of a torn chunk leaves the
                    # other's half stored (a partial chunk no reader can use).
                    existing.append(record)
                elif answer == ABSENT:
                    claimed.add(record.key)
                    missing.append(record)
                else:
                    self._reporter.failed(
                        emit, record, f"exist {record.key}: {describe(answer)}", FailReason.STORE_ERROR
                    )
            self._reporter.all_existing(emit, existing)
            if missing:
                await emit(tuple(missing))
            elif len(existing) == len(entry.item):
                # Everything is stored already. (Had any record failed, a drop would
                # count as partial success and hide that nothing was stored.)
                emit.drop("no object left to put")
