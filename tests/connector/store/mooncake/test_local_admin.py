"""A master's admin HTTP read off the command line of the ``mooncake_master`` serving its RPC port."""

from __future__ import annotations

import pytest

from kvpipe.connector.store.mooncake.local_admin import (
    _admin_of,
    _metadata_of,
    local_master_admin,
    master_flags,
)
from kvpipe.connector.store.mooncake.master import LocalMaster

SPAWNED = ["/venv/bin/mooncake_master", "--rpc_port=23820", "--rpc_address=127.0.0.1", "--metrics_port=27001"]


def test_gflags_take_both_spellings() -> None:
    assert master_flags(["m", "--port", "5", "--metrics_port=6", "--enable_ha=true"]) == {
        "port": "5",
        "metrics_port": "6",
        "enable_ha": "true",
    }


def test_the_command_line_serving_the_rpc_port_gives_its_metrics_port() -> None:
    assert _admin_of(SPAWNED, "127.0.0.1", 23820) == ("127.0.0.1", 27001)


def test_another_rpc_port_is_another_master() -> None:
    assert _admin_of(SPAWNED, "127.0.0.1", 23821) is None


def test_flags_left_out_are_mooncakes_defaults() -> None:
    assert _admin_of(["mooncake_master"], "127.0.0.1", 50051) == ("127.0.0.1", 9003)


def test_a_master_without_an_http_metadata_server_is_joined_peer_to_peer() -> None:
    assert _metadata_of(SPAWNED, "127.0.0.1", 23820) == "P2PHANDSHAKE"


def test_a_master_serving_http_metadata_names_its_url() -> None:
    flags = [*SPAWNED, "--enable_http_metadata_server=true", "--http_metadata_server_port=8090"]
    assert _metadata_of(flags, "127.0.0.1", 23820) == "http://127.0.0.1:8090/metadata"


def test_an_address_of_another_machine_is_not_looked_for_here() -> None:
    assert local_master_admin("198.18.0.7", 50051) is None  # the range reserved for tests: no host here has it


@pytest.mark.mooncake
def test_a_running_master_is_found_by_its_rpc_port() -> None:
    with LocalMaster() as master:
        assert master.endpoints is not None
        endpoints = master.endpoints
        assert local_master_admin(endpoints.host, endpoints.rpc_port) == (endpoints.host, endpoints.metrics_port)
