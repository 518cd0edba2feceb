"""``Store.capacity_bytes``: what the store's memory holds, through the wrappers every opened store has."""

from __future__ import annotations

from kvpipe.connector.cli.inspect.replay import KeyNames
from kvpipe.connector.store.configs import MemoryStoreConfig, connect
from kvpipe.connector.store.memory import MemoryStore
from kvpipe.connector.store.metered import OperationLog


def test_the_memory_store_holds_its_capacity() -> None:
    assert MemoryStore(8 << 20).capacity_bytes() == 8 << 20


def test_the_breaker_and_the_meter_pass_the_capacity_through() -> None:
    store = connect(MemoryStoreConfig(capacity=8 << 20), log=OperationLog())

    assert store.capacity_bytes() == 8 << 20


def test_a_store_of_key_names_knows_no_capacity() -> None:
    assert KeyNames(["k"]).capacity_bytes() is None
