"""``MooncakeStore.capacity_bytes`` on a real master: the segments other clients mount, read off its admin HTTP.

Mooncake's client API (0.3.13) has no call that lists segments or capacity, so a
client learns the store's capacity from the master's admin HTTP, where its address is
known (``master_metrics``, or a master the client spawned).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpipe.connector.bench.kvbench import MiB
from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster, free_port


@pytest.fixture(scope="module")
def master() -> Iterator[LocalMaster]:
    with LocalMaster() as master:
        yield master


def _settings(master: LocalMaster, segment: int, **fields: object) -> MooncakeSettings:
    assert master.endpoints is not None
    return MooncakeSettings.model_validate(
        {
            "master": master.endpoints.master_address,
            "metadata_server": master.endpoints.metadata_server,
            "global_segment_size": segment,
            "local_buffer_size": 16 * MiB,
            **fields,
        }
    )


def _admin(master: LocalMaster) -> list[str]:
    assert master.endpoints is not None
    return [f"{master.endpoints.host}:{master.endpoints.metrics_port}"]


def test_a_client_lending_nothing_reads_the_memory_another_client_lends(master: LocalMaster) -> None:
    with (
        MooncakeStore.open(_settings(master, 32 * MiB)),
        MooncakeStore.open(_settings(master, 0, master_metrics=_admin(master))) as engine,
    ):
        assert engine.capacity_bytes() == 32 * MiB


def test_every_mounted_segment_counts(master: LocalMaster) -> None:
    with (
        MooncakeStore.open(_settings(master, 32 * MiB)),
        MooncakeStore.open(_settings(master, 16 * MiB, master_metrics=_admin(master))) as engine,
    ):
        assert engine.capacity_bytes() == 48 * MiB


def test_objects_kept_in_two_copies_halve_the_capacity(master: LocalMaster) -> None:
    with (
        MooncakeStore.open(_settings(master, 32 * MiB)),
        MooncakeStore.open(_settings(master, 32 * MiB)),
        MooncakeStore.open(_settings(master, 0, master_metrics=_admin(master), replicas=2)) as engine,
    ):
        assert engine.capacity_bytes() == 32 * MiB


def test_without_the_admin_address_the_capacity_is_unknown(master: LocalMaster) -> None:
    with (
        MooncakeStore.open(_settings(master, 32 * MiB)),
        MooncakeStore.open(_settings(master, 0)) as engine,
    ):
        assert engine.capacity_bytes() is None


def test_an_admin_address_nothing_answers_at_leaves_the_capacity_unknown(master: LocalMaster) -> None:
    with (
        MooncakeStore.open(_settings(master, 32 * MiB)),
        MooncakeStore.open(_settings(master, 0, master_metrics=[f"127.0.0.1:{free_port()}"])) as engine,
    ):
        assert engine.capacity_bytes() is None


def test_a_store_with_no_segment_mounted_has_no_capacity_to_tell(master: LocalMaster) -> None:
    with MooncakeStore.open(_settings(master, 0, master_metrics=_admin(master))) as engine:
        assert engine.capacity_bytes() is None


@pytest.mark.mooncake
def test_a_client_knows_the_admin_address_of_the_master_it_spawned() -> None:
    settings = MooncakeSettings(global_segment_size=16 * MiB, local_buffer_size=16 * MiB)
    with MooncakeStore.open(settings) as store:
        assert store.capacity_bytes() == 16 * MiB
