"""What a fleet tells its kvpipe replicas for retention's default budget (docs/retention.md), no replica started."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpipe.connector.fleet.fleet import Fleet, FleetSpec
from kvpipe.connector.store.mooncake.master import LocalMaster

pytestmark = pytest.mark.mooncake


def _extra_config(spec: FleetSpec) -> tuple[dict[str, Any], str]:
    """A replica's ``kv_connector_extra_config``, and the fleet's master's admin HTTP (``host:port``)."""
    fleet = Fleet(spec)
    with LocalMaster() as master:
        assert master.endpoints is not None
        fleet.master = master
        transfer, _ = fleet._connector("127.0.0.1", "kv_both")
        assert transfer is not None
        return transfer[
            "kv_connector_extra_config"
        ], f"{master.endpoints.host}:{master.endpoints.metrics_port}"


def test_replicas_are_told_where_the_store_capacity_is_read(tmp_path: Path) -> None:
    extra, admin = _extra_config(FleetSpec(log_dir=tmp_path))

    assert extra["store"]["master_metrics"] == [admin]


def test_every_replica_counts_as_an_engine_that_pins(tmp_path: Path) -> None:
    extra, _ = _extra_config(FleetSpec(replicas=3, log_dir=tmp_path))

    assert extra["retention_writers"] == 3


def test_the_fleet_connector_settings_override_the_writer_count(tmp_path: Path) -> None:
    spec = FleetSpec(replicas=3, connector_settings={"retention_writers": 1}, log_dir=tmp_path)

    extra, _ = _extra_config(spec)

    assert extra["retention_writers"] == 1
