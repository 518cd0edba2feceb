"""What the stages that call the store share: per-key store calls, and removal.

A batch call answers per key. When it answers nothing usable (it raised, or gave
a result list of the wrong length) there is no way to know which answer belongs to
which object, so every record of the call fails; pairing results by position
with the wrong keys would be worse than failing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpipe.pipeline.stage import AnyStage

from .store import LoadingStore, SavingStore


class StoreCallError(Exception):
    """A batch store call gave no usable per-key answer; the message says why."""


async def call_per_key(
    stage: AnyStage, fn: Callable[..., Sequence[int]], keys: Sequence[str], *rest: Any
) -> list[int]:
    """Run ``fn(keys, *rest)`` in the stage's worker thread; one result per key, or StoreCallError."""
    try:
        results = await stage.run_blocking(fn, keys, *rest)
    except Exception as error:  # a store is outside our control: fail its records, not the pipeline
        raise StoreCallError(f"store call raised {type(error).__name__}: {error}") from error
    if len(results) != len(keys):
        raise StoreCallError(f"store answered {len(results)} results for {len(keys)} keys")
    return list(results)


def sizes_of(keys: Sequence[str], store: LoadingStore) -> list[int]:
    """Each of ``keys``' stored size (blocking; per key bytes or negative)."""
    return [store.get_size(key) for key in keys]


def remove_each(keys: Sequence[str], store: SavingStore | LoadingStore, force: bool) -> list[int]:
    """Remove each of ``keys`` (blocking; per key 0 or negative); unless ``force``, not a leased one.

    ``force`` only for objects no reader can use (a torn chunk's, a damaged one's): a
    lookup's ``batch_is_exist`` leases what it finds, so a hot chunk's objects may
    stay leased for as long as it is hot, and an unforced remove would leave them.
    Unforced for what a reader may still want (a demoted pin: a lease means a load
    is about to read it).
    """
    return [store.remove(key, force=force) for key in keys]
