"""Store backends for the connector tests, selected by name.

Every test that takes ``store``, ``kv`` or ``make_kv`` runs once per entry of
:data:`BACKENDS`. A backend is a factory: given the contract parameters
(:class:`StoreParams`) it yields a ready, EMPTY store and closes it afterwards.
``"memory"`` is the in-process model; ``"mooncake"`` is the real client on a
spawned ``mooncake_master``, so the very same contract suite holds the model to
the real store.

A real store costs ~1 s to open and ~3 s to close, so the mooncake backend keeps
one per distinct :class:`StoreParams` for the whole session (the lease TTL and
eviction knobs are master flags, the capacity is the client's segment) and hands
it out empty: between tests it force-removes every object, leased or not, and
checks on the master's admin endpoint that none is left. A store a test closed,
or one that will not come back empty, is replaced by a fresh one.
"""

from __future__ import annotations

import ctypes
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, replace

import pytest

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.protocol import Store


@dataclass(frozen=True)
class StoreParams:
    """What a contract test may ask of a backend: the master's knobs, nothing else.

    The real client refuses a segment under 16 MiB (setup() returns -600), so no
    test asks for less.
    """

    capacity_bytes: int = 64 << 20
    lease_ttl_s: float = 0.3
    high_watermark: float = 0.9  # the real master's default
    eviction_ratio: float = 0.05


Backend = Callable[[StoreParams], AbstractContextManager[Store]]


@contextmanager
def memory_backend(params: StoreParams) -> Iterator[Store]:
    store = MemoryStore(
        params.capacity_bytes,
        high_watermark=params.high_watermark,
        eviction_ratio=params.eviction_ratio,
        lease_ttl_s=params.lease_ttl_s,
    )
    try:
        yield store
    finally:
        store.close()


class MooncakeStores:
    """The session's real stores, one per :class:`StoreParams`, each lent to one test at a time."""

    def __init__(self) -> None:
        self._idle: dict[StoreParams, MooncakeStore] = {}

    @contextmanager
    def lend(self, params: StoreParams) -> Iterator[MooncakeStore]:
        store = self._idle.pop(params, None) or self._open(params)
        try:
            yield store
        finally:
            if params not in self._idle and self._emptied(store):
                self._idle[params] = store
            else:
                store.close()  # closed by the test, not emptied, or a second one of a kind

    def close_all(self) -> None:
        """Close every idle store; in parallel, as each close takes seconds."""
        stores, self._idle = list(self._idle.values()), {}
        with ThreadPoolExecutor(max_workers=max(1, len(stores))) as pool:
            list(pool.map(MooncakeStore.close, stores))

    @staticmethod
    def _open(params: StoreParams) -> MooncakeStore:
        return MooncakeStore.open(
            MooncakeSettings(
                global_segment_size=params.capacity_bytes,
                local_buffer_size=0,  # the contract uses registered buffers only
                lease_ttl_ms=round(params.lease_ttl_s * 1000),
                eviction_high_watermark=params.high_watermark,
                eviction_ratio=params.eviction_ratio,
            )
        )

    @staticmethod
    def _emptied(store: MooncakeStore) -> bool:
        """Force-remove every object and confirm on the master that none is left."""
        if store.closed:
            return False
        endpoints = store.endpoints
        assert endpoints is not None
        url = f"http://{endpoints.host}:{endpoints.metrics_port}/get_all_keys"
        for _ in range(20):
            try:
                if store.remove_all(force=True) >= 0:
                    with urllib.request.urlopen(url, timeout=2) as answer:
                        if not answer.read().strip():
                            return True
            except OSError:
                return False  # the master is unwell: start afresh
            time.sleep(0.05)
        return False


_MOONCAKE_STORES = MooncakeStores()


def mooncake_backend(params: StoreParams) -> AbstractContextManager[Store]:
    return _MOONCAKE_STORES.lend(params)


@pytest.fixture(scope="session", autouse=True)
def _close_mooncake_stores() -> Iterator[None]:
    yield
    _MOONCAKE_STORES.close_all()


BACKENDS: dict[str, Backend] = {"memory": memory_backend, "mooncake": mooncake_backend}


@dataclass
class Kv:
    """A store plus registered scratch buffers: the contract tests' vocabulary.

    Tests call the store's own API for the behaviour they specify and use these
    helpers for the setting up around it.
    """

    store: Store
    _buffers: list[ctypes.Array[ctypes.c_char]] = field(default_factory=list)

    def release(self) -> None:
        """Unregister every buffer this Kv registered (a real store outlives the test)."""
        for array in self._buffers:
            self.store.unregister_buffer(ctypes.addressof(array))
        self._buffers.clear()

    def buffer(self, data: bytes | int) -> int:
        """A registered buffer holding ``data`` (or that many zero bytes); its address."""
        if isinstance(data, int):
            array = (ctypes.c_char * data)()
        else:
            array = (ctypes.c_char * len(data)).from_buffer_copy(data)
        addr = ctypes.addressof(array)
        assert self.store.register_buffer(addr, len(array)) == 0
        self._buffers.append(array)
        return addr

    def put(
        self, objects: Mapping[str, bytes | Sequence[bytes]], group_ids: Sequence[str] | None = None
    ) -> list[int]:
        """One multi-buffer put: a value is one buffer's bytes, or a list of buffers' bytes."""
        parts = [[v] if isinstance(v, bytes) else list(v) for v in objects.values()]
        config = self.store.new_replicate_config()
        if group_ids is not None:
            config.group_ids = list(group_ids)
        return self.store.batch_put_from_multi_buffers(
            list(objects),
            [[self.buffer(p) for p in ps] for ps in parts],
            [[len(p) for p in ps] for ps in parts],
            config,
        )

    def get(self, key: str, *split: int) -> bytes | int:
        """The object's bytes, read into buffers of sizes ``split``; or the error code."""
        addrs = [self.buffer(n) for n in split]
        [result] = self.store.batch_get_into_multi_buffers([key], [addrs], [list(split)])
        if result < 0:
            return result
        return b"".join(ctypes.string_at(a, n) for a, n in zip(addrs, split, strict=True))

    def exists(self, *keys: str) -> list[int]:
        return self.store.batch_is_exist(list(keys))


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    return BACKENDS[request.param]


@pytest.fixture
def make_kv(backend: Backend) -> Iterator[Callable[..., Kv]]:
    """``make_kv(capacity_bytes=..., lease_ttl_s=...)``: a fresh store with those parameters."""
    with ExitStack() as stack:

        def make(**params: float) -> Kv:
            kv = Kv(stack.enter_context(backend(replace(StoreParams(), **params))))
            stack.callback(kv.release)
            return kv

        yield make


@pytest.fixture
def kv(make_kv: Callable[..., Kv]) -> Kv:
    return make_kv()


@pytest.fixture
def store(kv: Kv) -> Store:
    return kv.store
