"""A worker that lends the store nothing pins within the store's capacity, read off the real master.

The session's master holds only the segment its holder mounts (256 MB, a store node's
part); the engines mount none (``global_segment_size: 0``). Before, such a worker's
default budget was 0.9 of what it lends: nothing.
"""

from __future__ import annotations

from typing import Any

import structlog

from kvpipe.connector.engines import launch
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster
from kvpipe.stages.retention import PINNED_SHARE

from .test_connector_lifecycle import connector


def _store(master: LocalMaster, **fields: Any) -> dict[str, Any]:
    assert master.endpoints is not None
    return {**launch.store_section(master.endpoints), **fields}


def _admin(master: LocalMaster) -> list[str]:
    assert master.endpoints is not None
    return [f"{master.endpoints.host}:{master.endpoints.metrics_port}"]


def _budget_line(extra: dict[str, Any]) -> dict[str, Any]:
    """The worker's start-up line about its pin budget."""
    with structlog.testing.capture_logs() as logs:
        worker = connector(extra)
    worker.shutdown()
    (line,) = [entry for entry in logs if entry["event"] == "kvpipe retention budget"]
    return line


def test_a_worker_lending_nothing_pins_most_of_what_the_store_holds(
    master: LocalMaster, holder: MooncakeStore
) -> None:
    line = _budget_line({"store": _store(master, master_metrics=_admin(master))})

    capacity = holder.settings.global_segment_size
    assert (line["source"], line["store_capacity"]) == ("store capacity", capacity)
    assert line["pinned_bytes"] == int(capacity * PINNED_SHARE) > 0


def test_retention_writers_share_the_store_among_engines(master: LocalMaster, holder: MooncakeStore) -> None:
    line = _budget_line({"store": _store(master, master_metrics=_admin(master)), "retention_writers": 4})

    assert line["pinned_bytes"] == int(holder.settings.global_segment_size * PINNED_SHARE) // 4


def test_a_worker_that_cannot_read_the_capacity_keeps_the_lent_rule(
    master: LocalMaster, holder: MooncakeStore
) -> None:
    line = _budget_line({"store": _store(master)})

    assert (line["pinned_bytes"], line["source"]) == (0, "lent, capacity unknown")
