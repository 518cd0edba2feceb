"""Store doubles for the stage tests: a recorder around any store, a scripted store, stalled gets.

The recorder keeps every put call's parallel lists exactly as the stage built
them, which is what the alignment tests inspect. The scripted store answers each
key with a code chosen by the test, for cases a real store cannot be made to
produce on demand (a given key erroring on exist, any code mix in one call).
:class:`StalledGets` hangs its first gets until let go, as a read from a store
node cut off by the network does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.connector.store.protocol import ForwardingStore
from kvpipe.stages import Buffer, StoreObject


@dataclass(frozen=True)
class PutCall:
    keys: list[str]
    ptrs: list[list[int]]
    sizes: list[list[int]]
    group_ids: list[str] | None
    config: Any


class RecordingStore(ForwardingStore):
    """Forwards every call to ``inner`` and records the exist and put calls."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.exist_calls: list[list[str]] = []
        self.exist_answers: list[list[int]] = []
        self.put_calls: list[PutCall] = []

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self.exist_calls.append(list(keys))
        answers = super().batch_is_exist(keys)
        self.exist_answers.append(list(answers))
        return answers

    def batch_put_from_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], config: Any
    ) -> list[int]:
        group_ids = getattr(config, "group_ids", None)
        self.put_calls.append(
            PutCall(list(keys), [list(p) for p in ptrs], [list(s) for s in sizes], group_ids, config)
        )
        return super().batch_put_from_multi_buffers(keys, ptrs, sizes, config)

    def __getattr__(self, name: str) -> Any:  # what the store under it has beyond the protocol
        return getattr(self.inner, name)

    @property
    def put_keys(self) -> list[str]:
        return [key for call in self.put_calls for key in call.keys]


class ScriptedConfig:
    """A replicate config with ``group_ids``, as a store that supports them has."""

    def __init__(self, soft_pin_ttl_ms: int | None = None) -> None:
        self.group_ids: list[str] | None = None
        self.soft_pin_ttl_ms = soft_pin_ttl_ms


class ScriptedStore:
    """Answers each key with ``exist(key)`` / ``put(key)``; stores nothing."""

    def __init__(
        self,
        exist: Callable[[str], int] = lambda key: 0,
        put: Callable[[str], int] = lambda key: 0,
        *,
        supports_group_ids: bool = True,
    ) -> None:
        self._exist = exist
        self._put = put
        self.supports_group_ids = supports_group_ids
        self.local_transfers = True
        self.removed: list[str] = []

    def new_replicate_config(self, *, soft_pin_ttl_ms: int | None = None) -> ScriptedConfig:
        return ScriptedConfig(soft_pin_ttl_ms)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return [self._exist(key) for key in keys]

    def batch_put_from_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], config: Any
    ) -> list[int]:
        return [self._put(key) for key in keys]

    def remove(self, key: str, *, force: bool = False) -> int:
        self.removed.append(key)
        return 0

    def register_buffer(self, addr: int, nbytes: int) -> int:
        return 0

    def unregister_buffer(self, addr: int) -> int:
        return 0


def by_first_sight(codes: Sequence[int]) -> Callable[[str], int]:
    """Give each new key the next code of ``codes`` (cycling), and always the same one after."""
    assigned: dict[str, int] = {}

    def code(key: str) -> int:
        return assigned.setdefault(key, codes[len(assigned) % len(codes)])

    return code


def fake_record(
    key: str,
    *,
    buffers: int = 1,
    chunk_hash: bytes = b"\xaa",
    group_id: str | None = None,
    reuse: int = 0,
    handoff: bool = False,
) -> StoreObject:
    """A record whose buffers point nowhere: for stores that never read memory."""
    return StoreObject(
        key=key,
        chunk_hash=chunk_hash,
        store_group=0,
        buffers=tuple(Buffer(0x1000 * (i + 1), 64) for i in range(buffers)),
        group_id=group_id,
        reuse=reuse,
        handoff=handoff,
    )


class _Stalling(MemoryStore):
    """A store whose next ``stalled`` calls of one kind hang until :attr:`let_go` is set (60 s at most)."""

    def __init__(self, stalled: int = 1) -> None:
        super().__init__(16 << 20)
        self.let_go = threading.Event()
        self.hanging = 0  # calls waiting now
        self.stalled = stalled  # calls still to hang
        self._lock = threading.Lock()

    def _hang_if_stalled(self) -> None:
        with self._lock:
            stall = self.stalled > 0
            self.stalled -= stall
            self.hanging += stall
        if stall:
            self.let_go.wait(60.0)
            with self._lock:
                self.hanging -= 1


class StalledGets(_Stalling):
    """A store whose first ``stalled`` gets hang until :attr:`let_go` is set."""

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        self._hang_if_stalled()
        return super().batch_get_into_multi_buffers(keys, ptrs, sizes)


class StalledPuts(_Stalling):
    """A store whose next ``stalled`` puts hang until :attr:`let_go` is set."""

    def batch_put_from_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], config: Any
    ) -> list[int]:
        self._hang_if_stalled()
        return super().batch_put_from_multi_buffers(keys, ptrs, sizes, config)


class StalledRanges(_Stalling):
    """A store whose ranged gets hang from the ``after``-th on (0: the first), ``stalled`` of them, until :attr:`let_go`."""

    def __init__(self, after: int, stalled: int = 1) -> None:
        super().__init__(stalled)
        self.ranged_calls = 0
        self._after = after

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        self.ranged_calls += 1
        if self.ranged_calls > self._after:
            self._hang_if_stalled()
        return super().batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets)
