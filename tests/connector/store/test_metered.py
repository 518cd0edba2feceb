"""The store meter: one record per master call, with what the call moved and what failed."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from kvpipe.connector.store.breaker import BreakerSettings
from kvpipe.connector.store.configs import guarded
from kvpipe.connector.store.memory import Faults, MemoryStore
from kvpipe.connector.store.metered import MeteredStore, OperationLog
from kvpipe.stages.store import Code


class Ticks:
    """A clock that moves one second per reading: a call's time is exactly 1.0."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def memory() -> Iterator[MemoryStore]:
    store = MemoryStore(8 << 20)
    yield store
    store.close()


@pytest.fixture
def buffer(memory: MemoryStore) -> Iterator[int]:
    array = (ctypes.c_char * 4096)()
    address = ctypes.addressof(array)
    assert memory.register_buffer(address, 4096) == 0
    yield address
    memory.unregister_buffer(address)


def metered(store: MemoryStore) -> tuple[MeteredStore, OperationLog]:
    log = OperationLog()
    return MeteredStore(store, log, clock=Ticks()), log


def test_a_put_records_its_keys_and_the_bytes_it_stored(memory: MemoryStore, buffer: int) -> None:
    store, log = metered(memory)
    codes = store.batch_put_from_multi_buffers(
        ["a", "b"], [[buffer, buffer + 100], [buffer]], [[100, 28], [64]], store.new_replicate_config()
    )
    assert codes == [0, 0]
    assert log.drain() == ([("put", "ok", 1.0, 2, 192, 0)], 0)


def test_a_get_records_the_bytes_it_read_and_counts_missing_keys_failed(
    memory: MemoryStore, buffer: int
) -> None:
    store, log = metered(memory)
    store.batch_put_from(["a"], [buffer], [64], store.new_replicate_config())
    log.drain()
    assert store.batch_get_into(["a", "missing"], [buffer, buffer + 64], [64, 64]) == [64, Code.NOT_FOUND]
    assert log.drain() == ([("get", "error", 1.0, 2, 64, 1)], 0)


def test_an_exist_moves_no_bytes_and_an_absent_key_is_no_failure(memory: MemoryStore) -> None:
    store, log = metered(memory)
    assert store.batch_is_exist(["a", "b", "c"]) == [0, 0, 0]
    assert log.drain() == ([("exist", "ok", 1.0, 3, 0, 0)], 0)


def test_a_master_outage_records_every_key_failed(memory: MemoryStore) -> None:
    store, log = metered(memory)
    memory.faults = Faults(outage="down")
    assert store.batch_is_exist(["a", "b"]) == [Code.RPC_FAILED] * 2
    assert log.drain() == ([("exist", "error", 1.0, 2, 0, 2)], 0)


def test_a_call_that_raises_is_recorded_before_the_error_goes_on(
    memory: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(keys: object) -> list[int]:
        raise RuntimeError("binding error")

    monkeypatch.setattr(memory, "batch_is_exist", broken)
    store, log = metered(memory)
    with pytest.raises(RuntimeError):
        store.batch_is_exist(["a", "b"])
    assert log.drain() == ([("exist", "error", 1.0, 2, 0, 2)], 0)


def test_a_drain_empties_the_log() -> None:
    log = OperationLog()
    log.add(("exist", "ok", 0.1, 1, 0, 0))
    assert log.drain()[0] and log.drain() == ([], 0)


def test_a_full_log_refuses_records_and_counts_them() -> None:
    log = OperationLog(limit=2)
    for _ in range(5):
        log.add(("exist", "ok", 0.1, 1, 0, 0))
    records, refused = log.drain()
    assert len(records) == 2 and refused == 3


def test_behind_a_breaker_only_calls_that_reached_the_store_are_recorded(memory: MemoryStore) -> None:
    log = OperationLog()
    store = guarded(memory, BreakerSettings(failures_to_open=1, open_s=60.0), log)
    memory.faults = Faults(outage="down")
    store.batch_is_exist(["a"])  # reaches the store, fails, opens the breaker
    store.batch_is_exist(["a"])  # refused by the open breaker: never a store call
    records, _ = log.drain()
    assert [(op, status) for op, status, *_ in records] == [("exist", "error")]
