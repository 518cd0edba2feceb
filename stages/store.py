"""The object-store calls the KV stages make, one protocol per role, and what their codes mean.

- :class:`SavingStore`: what the save stages need (existence checks, multi-buffer
  puts, removal of a torn chunk's objects, staging registration, capabilities);
- :class:`LoadingStore`: what lookups and loads need (existence checks, reads into
  the engine's buffers, removal of an object found damaged, seal memory registration).

The stages speak to a store through these structural protocols only; the backend
contract, ``kvpipe.connector.store.protocol.Store``, is their union plus what only a
backend offers. Backends (an in-process model and the real Mooncake client) satisfy
them without importing anything from here but the codes. The calls are Mooncake
Store's batch API because that is the store we serve, and batch calls are what
keeps a KV save to a handful of round trips.

Results are per key and never exceptions: ``0`` (or a byte count for reads) is
success, a negative value is a :class:`Code`. Callers must not read an error code
as "absent": ``batch_is_exist`` returning ``-900`` means "don't know".
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Any, Protocol, runtime_checkable


class Code(IntEnum):
    """Per-key result codes (Mooncake's numbering)."""

    OK = 0
    NO_SPACE = -200  # no available handle: the store is full right now
    INVALID_PARAMS = -600
    NOT_FOUND = -704
    ALREADY_EXISTS = -705  # a put of a key that is stored: the object is there
    HAS_LEASE = -706
    TRANSFER_FAILED = -800
    RPC_FAILED = -900  # master unreachable
    RPC_TIMEOUT = -901  # master stalled


#: ``batch_is_exist``'s answer for a stored object (0 is absent; a negative code, unknown).
EXISTS = 1
#: The longest soft pin a master takes (a day): a put asking for more is refused with -600.
MAX_SOFT_PIN_TTL_S = 86400


def describe(code: int) -> str:
    """``-200`` -> ``"-200 (NO_SPACE)"``; unknown codes are shown as numbers."""
    try:
        return f"{code} ({Code(code).name})"
    except ValueError:
        return str(code)


@runtime_checkable
class SavingStore(Protocol):
    """The store calls the save stages make."""

    @property
    def supports_group_ids(self) -> bool:
        """Whether replicate configs of this store accept ``group_ids``."""
        ...

    @property
    def local_transfers(self) -> bool:
        """Whether puts are copies within this host's memory rather than network transfers.

        Over a network every buffer of an object is a transfer of its own (about
        30 us each over TCP), so gathering many small buffers into one pays; a
        local copy costs little per buffer, and gathering first only adds a copy.
        """
        ...

    def new_replicate_config(self, *, soft_pin_ttl_ms: int | None = None) -> Any:
        """A fresh replicate config. Never share one between calls: puts may overlap.

        ``soft_pin_ttl_ms``: the objects put with it are soft-pinned that long (evicted
        only when nothing unpinned is left); a store without soft pins ignores it.
        """
        ...

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """Per key: 1 stored, 0 absent, negative on error."""
        ...

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        config: Any,
    ) -> list[int]:
        """Store each key's buffers concatenated. Per key: 0 or negative."""
        ...

    def batch_put_session_start(self, keys: Sequence[str], sizes: Sequence[int], config: Any) -> list[int]:
        """Reserve each object (``sizes[i]`` bytes, ``config``'s group ids and pin) for ranged puts.

        Per key: 0; ``ALREADY_EXISTS`` (stored: nothing to write); ``INVALID_PARAMS``
        (another writer's session holds it); ``NO_SPACE``. A reserved object is
        invisible (exists 0) until :meth:`batch_put_session_end`; one whose writer
        never ends it is dropped by the master after its discard timeout.
        """
        ...

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """Write byte ranges of reserved objects: ``sizes[i][j]`` bytes from ``ptrs[i][j]`` at
        ``offsets[i][j]`` of object ``keys[i]``. Per key: the bytes written, or negative."""
        ...

    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        """Make each reserved object visible, as written: the store does not check that every byte was. Per key: 0 or negative."""
        ...

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        """Drop each reserved object unseen, its room freed. Per key: 0 or negative."""
        ...

    def remove(self, key: str, *, force: bool = False) -> int:
        """Delete one object: 0, -704 if missing, -706 while a reader holds its lease.

        ``force`` removes a leased object too: only for objects no reader can use
        (a torn chunk's), as a lease may be a reader's copy in flight.
        """
        ...

    def register_buffer(self, addr: int, nbytes: int) -> int:
        """Make ``nbytes`` at ``addr`` usable by puts (staging memory). 0 or negative."""
        ...

    def unregister_buffer(self, addr: int) -> int:
        """Forget a registration made at ``addr``. 0, or -600 if there is none."""
        ...


@runtime_checkable
class LoadingStore(Protocol):
    """The store calls lookups and loads make."""

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """Per key: 1 stored, 0 absent, negative on error (a read: it leases what it finds)."""
        ...

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Read each object into its buffers. Per key: bytes read or negative."""
        ...

    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        """Open a get session on each key (its replicas asked once): 0, or negative (``NOT_FOUND``).

        Ranged gets (:meth:`batch_get_into_multi_buffer_ranges`) read only keys in a
        session. A session is one per key per client, not counted: the first
        :meth:`batch_get_session_end` of a key closes it for every reader.
        """
        ...

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """Read byte ranges of objects in a session: ``sizes[i][j]`` bytes from ``offsets[i][j]`` of
        object ``keys[i]`` into ``ptrs[i][j]``. Per key: the bytes read, or negative
        (``INVALID_PARAMS``: no session on the key, or a range past the object's end)."""
        ...

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        """Close the get sessions of ``keys`` (those that have none are skipped): 0 or negative."""
        ...

    def remove(self, key: str, *, force: bool = False) -> int:
        """Delete one object (a damaged one a load found): 0 or negative, as :meth:`SavingStore.remove`."""
        ...

    def get_size(self, key: str) -> int:
        """The object's size in bytes, or negative (``NOT_FOUND``); asked only of seals whose read failed."""
        ...

    def register_buffer(self, addr: int, nbytes: int) -> int:
        """Make ``nbytes`` at ``addr`` usable by gets (seal memory). 0 or negative."""
        ...

    def unregister_buffer(self, addr: int) -> int:
        """Forget a registration made at ``addr``. 0, or -600 if there is none."""
        ...
