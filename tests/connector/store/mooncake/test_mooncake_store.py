"""The real backend's own behaviour: settings, vLLM's config file, opening, closing, buffers.

What every store does is in the contract suite (``test_store_contract.py``,
which runs against a real master too); this file covers what only the Mooncake
backend has: its settings and their errors, vLLM's JSON config, the fast
reachability check, the closed state, and the master it spawns or joins.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvpipe.connector.store.mooncake import (
    MooncakeConfigError,
    MooncakeError,
    MooncakeSettings,
    MooncakeStore,
    harness,
    parse_size,
)
from kvpipe.connector.store.mooncake import master as master_module
from kvpipe.connector.store.mooncake.environment import TRANSFER_TIMEOUT_ENV
from kvpipe.connector.store.mooncake.listening import is_listening
from kvpipe.connector.store.mooncake.master import LocalMaster, MasterError, free_port
from kvpipe.connector.store.mooncake.master_resolution import ResolvedMaster
from kvpipe.connector.store.mooncake.registry import REGISTRY
from kvpipe.stages.store import Code

MiB = 1 << 20
GiB = 1 << 30
SETUP_RETRY_S = 90.0  # how long the client's own setup() retries with no master
MASTER_RPC_WAIT_S = 30.0  # how long a master RPC waits by default for a stopped master


# -- sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (268435456, 268435456),
        ("268435456", 268435456),
        ("256MB", 256 * MiB),
        ("256mb", 256 * MiB),
        (" 256 MB ", 256 * MiB),
        ("1GB", GiB),
        ("1.5GB", 3 * GiB // 2),
        ("64KB", 64 << 10),
        ("100b", 100),
        ("16MiB", 16 * MiB),
        (2.9, 2),
    ],
)
def test_sizes_parse_as_vllm_parses_them_with_binary_units(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["lots", "256 M", "1.2.3GB", "-5MB", "", True, None, [1]])
def test_a_bad_size_names_the_field_and_the_value(bad: object) -> None:
    with pytest.raises(ValidationError) as caught:
        MooncakeSettings(global_segment_size=bad)
    message = str(caught.value)
    assert "global_segment_size" in message and repr(bad) in message


def test_a_segment_under_16_mib_is_refused_saying_why() -> None:
    with pytest.raises(ValidationError) as caught:
        MooncakeSettings(global_segment_size="8MB")
    message = str(caught.value)
    assert "global_segment_size" in message and "16 MiB" in message and "'8MB'" in message


def test_a_segment_of_0_mounts_none_and_needs_someone_elses_segments() -> None:
    existing = MooncakeSettings(
        master="127.0.0.1:50051", metadata_server="P2PHANDSHAKE", global_segment_size=0
    )
    assert existing.global_segment_size == 0
    with pytest.raises(ValidationError, match="global_segment_size") as caught:
        MooncakeSettings(global_segment_size=0)
    assert "spawned master" in str(caught.value)


def test_a_local_buffer_may_be_small_but_not_negative() -> None:
    assert MooncakeSettings(local_buffer_size="0").local_buffer_size == 0
    with pytest.raises(ValidationError, match="local_buffer_size"):
        MooncakeSettings(local_buffer_size=-1)


# -- settings ------------------------------------------------------------------------------


def test_the_defaults_spawn_a_master_with_a_256_mib_segment() -> None:
    settings = MooncakeSettings()
    assert (settings.master, settings.metadata_server, settings.protocol) == ("spawn", None, "tcp")
    assert (settings.global_segment_size, settings.local_buffer_size) == (256 * MiB, 64 * MiB)


@pytest.mark.parametrize("bad", ["localhost", "10.0.0.1:", ":50051", "host:99999", "host:port", "a b:1"])
def test_a_bad_master_address_names_the_field_and_the_value(bad: str) -> None:
    with pytest.raises(ValidationError) as caught:
        MooncakeSettings(master=bad, metadata_server="P2PHANDSHAKE")
    message = str(caught.value)
    assert "master" in message and repr(bad) in message and "host:port" in message


def test_an_existing_master_needs_a_metadata_server() -> None:
    with pytest.raises(ValidationError, match="metadata_server"):
        MooncakeSettings(master="127.0.0.1:50051")


@pytest.mark.parametrize(
    "metadata", ["P2PHANDSHAKE", "http://10.0.0.1:8080/metadata", "etcd://10.0.0.1:2379"]
)
def test_metadata_servers_mooncake_knows_are_accepted(metadata: str) -> None:
    assert MooncakeSettings(master="10.0.0.1:50051", metadata_server=metadata).metadata_server == metadata


@pytest.mark.parametrize("bad", ["nowhere", "ftp://x:1/metadata", "http://x:99999/metadata"])
def test_a_bad_metadata_server_names_the_field_and_the_value(bad: str) -> None:
    with pytest.raises(ValidationError) as caught:
        MooncakeSettings(master="127.0.0.1:50051", metadata_server=bad)
    assert "metadata_server" in str(caught.value) and repr(bad) in str(caught.value)


def test_an_unknown_field_is_named() -> None:
    with pytest.raises(ValidationError) as caught:
        MooncakeSettings(global_segment="1GB")
    assert "global_segment" in str(caught.value) and "'1GB'" in str(caught.value)


@pytest.mark.parametrize(
    ("knob", "value"),
    [("lease_ttl_ms", 500), ("eviction_high_watermark", 0.8), ("eviction_ratio", 0.1), ("client_ttl_s", 5)],
)
def test_the_spawned_master_knobs_are_refused_with_an_existing_master(knob: str, value: object) -> None:
    with pytest.raises(ValidationError) as caught:
        MooncakeSettings(master="127.0.0.1:50051", metadata_server="P2PHANDSHAKE", **{knob: value})
    assert knob in str(caught.value) and "spawn" in str(caught.value)


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("eviction_high_watermark", 1.5),
        ("eviction_ratio", -0.1),
        ("lease_ttl_ms", -1),
        ("connect_timeout_s", 0),
    ],
)
def test_out_of_range_knobs_name_the_field(knob: str, value: object) -> None:
    with pytest.raises(ValidationError, match=knob):
        MooncakeSettings(**{knob: value})


# -- vLLM's JSON file ----------------------------------------------------------------------


def write_json(tmp_path: Path, document: object) -> Path:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(document))
    return path


VLLM_FILE = {
    "metadata_server": "http://10.0.0.1:8080/metadata",
    "master_server_address": "10.0.0.1:50051",
    "protocol": "tcp",
    "device_name": "",
    "global_segment_size": "1GB",
    "local_buffer_size": "64MB",
}


def test_settings_come_from_vllms_json_file_with_sizes_as_strings(tmp_path: Path) -> None:
    path = write_json(tmp_path, VLLM_FILE)
    settings = MooncakeSettings.from_vllm_file(path, env={})
    assert settings.master == "10.0.0.1:50051"
    assert settings.metadata_server == "http://10.0.0.1:8080/metadata"
    assert (settings.global_segment_size, settings.local_buffer_size) == (GiB, 64 * MiB)
    assert settings.local_hostname == "127.0.0.1"


def test_vllms_json_may_name_an_ha_cluster_as_its_master(tmp_path: Path) -> None:
    document = {
        **VLLM_FILE,
        "master_server_address": "etcd://10.0.0.1:2379;10.0.0.2:2379",
        "metadata_server": "P2PHANDSHAKE",
    }
    settings = MooncakeSettings.from_vllm_file(write_json(tmp_path, document), env={})
    assert settings.master == "etcd://10.0.0.1:2379;10.0.0.2:2379"


def test_the_local_hostname_comes_from_vllms_environment_variable(tmp_path: Path) -> None:
    path = write_json(tmp_path, VLLM_FILE)
    env = {"MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "10.0.0.7"}
    settings = MooncakeSettings.from_vllm_env(env, connect_timeout_s=1.0)
    assert (settings.local_hostname, settings.connect_timeout_s) == ("10.0.0.7", 1.0)


def test_missing_optional_fields_take_vllms_defaults(tmp_path: Path) -> None:
    path = write_json(tmp_path, {k: VLLM_FILE[k] for k in ("metadata_server", "master_server_address")})
    settings = MooncakeSettings.from_vllm_file(path, env={})
    assert (settings.protocol, settings.device_name) == ("rdma", "")
    assert settings.global_segment_size == settings.local_buffer_size == 4 * GiB


@pytest.mark.parametrize(
    ("change", "field", "shown"),
    [
        ({"global_segment_size": "8MB"}, "global_segment_size", "'8MB'"),
        ({"local_buffer_size": "much"}, "local_buffer_size", "'much'"),
        ({"master_server_address": "10.0.0.1"}, "master_server_address", "'10.0.0.1'"),
        ({"metadata_server": "nowhere"}, "metadata_server", "'nowhere'"),
        ({"segment_size": "1GB"}, "segment_size", "'1GB'"),
        ({"mode": "standalone-store"}, "mode", "'1GB'"),
        ({"mode": "embedded", "global_segment_size": 0}, "mode", "0"),
        ({"mode": "disaggregated"}, "mode", "'disaggregated'"),
        ({"enable_offload": "yes"}, "enable_offload", "'yes'"),
    ],
)
def test_a_bad_field_in_the_file_names_the_file_the_field_and_the_value(
    tmp_path: Path, change: dict[str, Any], field: str, shown: str
) -> None:
    path = write_json(tmp_path, {**VLLM_FILE, **change})
    with pytest.raises(MooncakeConfigError) as caught:
        MooncakeSettings.from_vllm_file(path, env={})
    message = str(caught.value)
    assert message.startswith(f"{path}: {field}: ") and shown in message


def test_standalone_store_mode_mounts_no_segment_and_offload_is_accepted(tmp_path: Path) -> None:
    document = {**VLLM_FILE, "mode": "standalone-store", "global_segment_size": 0, "enable_offload": True}
    settings = MooncakeSettings.from_vllm_file(write_json(tmp_path, document), env={})
    assert settings.global_segment_size == 0


def test_a_required_field_missing_from_the_file_is_named(tmp_path: Path) -> None:
    path = write_json(tmp_path, {k: v for k, v in VLLM_FILE.items() if k != "master_server_address"})
    with pytest.raises(MooncakeConfigError, match="master_server_address: is required"):
        MooncakeSettings.from_vllm_file(path, env={})


@pytest.mark.parametrize(("content", "problem"), [("{not json", "not valid JSON"), ("[1]", "JSON object")])
def test_an_unreadable_file_is_named(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(content)
    with pytest.raises(MooncakeConfigError, match=problem) as caught:
        MooncakeSettings.from_vllm_file(path, env={})
    assert str(path) in str(caught.value)
    with pytest.raises(MooncakeConfigError, match="cannot read"):
        MooncakeSettings.from_vllm_file(tmp_path / "missing.json", env={})


def test_the_environment_must_name_the_file() -> None:
    with pytest.raises(MooncakeConfigError, match="MOONCAKE_CONFIG_PATH"):
        MooncakeSettings.from_vllm_env({})


# -- loading the client --------------------------------------------------------------------


def test_importing_the_backend_does_not_load_mooncake() -> None:
    code = "import sys, kvpipe.connector.store.mooncake.client; assert 'mooncake' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


class _Refuse:
    """A meta-path finder that fails the import of ``mooncake.store`` with ``message``."""

    def __init__(self, message: str) -> None:
        self.message = message

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == "mooncake.store":
            raise ImportError(self.message)
        return None


@pytest.mark.parametrize(
    ("message", "advice"),
    [
        ("No module named 'mooncake'", "pip install"),
        ("libibverbs.so.1: cannot open shared object file", "apt-get install -y libibverbs1"),
    ],
)
def test_a_client_that_cannot_load_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, message: str, advice: str
) -> None:
    monkeypatch.delitem(sys.modules, "mooncake.store", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Refuse(message), *sys.meta_path])
    with pytest.raises(MooncakeError, match=advice):
        MooncakeStore.open(MooncakeSettings(master="127.0.0.1:1", metadata_server="P2PHANDSHAKE"))


# -- opening -------------------------------------------------------------------------------


def test_an_unreachable_master_fails_in_seconds_with_one_line() -> None:
    port = free_port()
    settings = MooncakeSettings(
        master=f"127.0.0.1:{port}", metadata_server="P2PHANDSHAKE", connect_timeout_s=0.5
    )
    started = time.monotonic()
    with pytest.raises(MasterError) as caught:
        MooncakeStore.open(settings)
    assert time.monotonic() - started < SETUP_RETRY_S / 9  # never the client's own set-up retry
    message = str(caught.value)
    assert "\n" not in message and f"127.0.0.1:{port}" in message and "not reachable" in message


def test_an_unreachable_http_metadata_server_fails_in_seconds_too() -> None:
    with socket.socket() as master:  # something listens where the master should be
        master.bind(("127.0.0.1", 0))
        master.listen()
        master_port = master.getsockname()[1]
        metadata_port = free_port()
        settings = MooncakeSettings(
            master=f"127.0.0.1:{master_port}",
            metadata_server=f"http://127.0.0.1:{metadata_port}/metadata",
            connect_timeout_s=0.5,
        )
        started = time.monotonic()
        with pytest.raises(MasterError, match=f"metadata server at 127.0.0.1:{metadata_port}"):
            MooncakeStore.open(settings)
        assert time.monotonic() - started < SETUP_RETRY_S / 9


def test_a_failed_setup_names_its_code_and_stops_the_spawned_master(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[LocalMaster] = []
    real_start = LocalMaster.start

    def start(self: LocalMaster, endpoints: Any = None) -> LocalMaster:
        started.append(self)
        return real_start(self, endpoints)

    monkeypatch.setattr(LocalMaster, "start", start)
    # Validation refuses a small segment; construct past it to reach the client's own check.
    settings = MooncakeSettings.model_construct(
        **{**MooncakeSettings().model_dump(), "global_segment_size": 8 * MiB}
    )
    with pytest.raises(MooncakeError, match="-600"):
        MooncakeStore.open(settings)
    [master] = started
    assert master.pid is None
    assert master.endpoints is not None and not is_listening("127.0.0.1", master.endpoints.rpc_port)


def test_a_master_whose_free_port_was_taken_meanwhile_starts_on_new_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_free_ports = master_module.free_ports
    picked: list[list[int]] = []
    with socket.socket() as squatter:  # takes the admin port between picking and binding
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]

        def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
            ports = real_free_ports(count, host)
            if not picked:
                ports[-1] = taken
            picked.append(ports)
            return ports

        monkeypatch.setattr(master_module, "free_ports", free_ports)
        with LocalMaster() as master:
            assert len(picked) == 2 and master.endpoints is not None
            assert master.endpoints.metrics_port == picked[1][-1] != taken


UNSTOPPED_OWNER = """
import os
import sys

from kvpipe.connector.store.mooncake.master import LocalMaster

master = LocalMaster().start()  # never stopped
print(master.pid, flush=True)
if (child := os.fork()) == 0:
    sys.exit(0)  # a forked child runs the exit hooks too: it must not stop its parent's master
os.waitpid(child, 0)
print(master.pid is not None and os.kill(master.pid, 0) is None, flush=True)
"""


def test_a_master_its_owner_never_stopped_is_stopped_when_the_owner_exits() -> None:
    owner = subprocess.run(
        [sys.executable, "-c", UNSTOPPED_OWNER], capture_output=True, text=True, timeout=60, check=True
    )
    pid, alive_after_the_child = owner.stdout.split()
    assert alive_after_the_child == "True"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)


def test_ports_handed_out_for_a_later_bind_lie_below_the_kernels_ephemeral_range() -> None:
    """A standby master binds its port only once promoted: no port the kernel picks meanwhile may be it."""
    low, _ = (int(part) for part in master_module.EPHEMERAL_RANGE_FILE.read_text().split())
    ports = master_module.free_ports(8)
    assert len(set(ports)) == 8
    assert all(master_module.HANDOUT_FLOOR <= port < low for port in ports)


def test_with_no_room_below_the_ephemeral_range_the_kernel_picks_the_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1024\t65535\n")
    monkeypatch.setattr(master_module, "EPHEMERAL_RANGE_FILE", wide)
    assert not master_module.handout_range()
    assert len(set(master_module.free_ports(3))) == 3


def round_trip(store: MooncakeStore, key: str, payload: bytes) -> bytes:
    src = ctypes.create_string_buffer(payload, len(payload))
    dst = ctypes.create_string_buffer(len(payload))
    for buffer in (src, dst):
        assert store.register_buffer(ctypes.addressof(buffer), len(payload)) == 0
    try:
        config = store.new_replicate_config()
        assert store.batch_put_from([key], [ctypes.addressof(src)], [len(payload)], config) == [0]
        assert store.batch_get_into([key], [ctypes.addressof(dst)], [len(payload)]) == [len(payload)]
        return dst.raw
    finally:
        for buffer in (src, dst):
            store.unregister_buffer(ctypes.addressof(buffer))


def test_stores_join_an_existing_master_from_vllms_file_and_leave_it_running(tmp_path: Path) -> None:
    """An embedded client holds a segment; a standalone one stores there, so its objects outlive it."""
    with LocalMaster() as master:
        assert master.endpoints is not None
        common = {
            **VLLM_FILE,
            "master_server_address": master.endpoints.master_address,
            "metadata_server": master.endpoints.metadata_server,
            "local_buffer_size": "1MB",
        }
        (tmp_path / "embedded").mkdir()
        (tmp_path / "standalone").mkdir()
        embedded = write_json(tmp_path / "embedded", {**common, "global_segment_size": "16MB"})
        standalone = write_json(
            tmp_path / "standalone", {**common, "mode": "standalone-store", "global_segment_size": 0}
        )
        env = {"MOONCAKE_CONFIG_PATH": str(embedded), "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}
        with MooncakeStore.open(MooncakeSettings.from_vllm_env(env)) as holder:
            assert holder.endpoints is None and holder.spawned_master is None
            assert holder.master_address == master.endpoints.master_address
            with MooncakeStore.open(MooncakeSettings.from_vllm_file(standalone, env={})) as writer:
                assert round_trip(writer, "kept", b"over an existing master") == b"over an existing master"
            assert holder.batch_is_exist(["kept"]) == [1]  # in the holder's segment: outlives the writer
        assert is_listening("127.0.0.1", master.endpoints.rpc_port)


def test_an_open_store_leaves_its_transfer_deadline_where_the_transport_reads_it_at_each_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(REGISTRY, "user_environment", dict)  # whatever the test process was started with
    monkeypatch.delenv(TRANSFER_TIMEOUT_ENV, raising=False)
    settings = MooncakeSettings(global_segment_size="16MB", local_buffer_size=0, transfer_timeout_s=4)
    with MooncakeStore.open(settings):
        assert os.environ[TRANSFER_TIMEOUT_ENV] == "4"


def test_a_transfer_deadline_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(REGISTRY, "user_environment", lambda: {TRANSFER_TIMEOUT_ENV: "7"})
    monkeypatch.setenv(TRANSFER_TIMEOUT_ENV, "7")
    settings = MooncakeSettings(global_segment_size="16MB", local_buffer_size=0, transfer_timeout_s=4)
    with MooncakeStore.open(settings):
        assert os.environ[TRANSFER_TIMEOUT_ENV] == "7"


# -- a spawned master, and closing ---------------------------------------------------------


@pytest.fixture(scope="module")
def spawned() -> Iterator[MooncakeStore]:
    with MooncakeStore.open(MooncakeSettings(global_segment_size="16MB", local_buffer_size=0)) as store:
        yield store


def test_a_spawned_store_reports_its_endpoints(spawned: MooncakeStore) -> None:
    endpoints = spawned.endpoints
    assert endpoints is not None and endpoints.host == "127.0.0.1"
    assert spawned.master_address == endpoints.master_address
    assert spawned.metadata_server == endpoints.metadata_server
    assert spawned.supports_group_ids
    assert "spawned" in repr(spawned) and "open" in repr(spawned)


def test_ctypes_memory_registers_and_round_trips(spawned: MooncakeStore) -> None:
    assert round_trip(spawned, "ctypes", b"\x00\x01kv block\xff") == b"\x00\x01kv block\xff"


def test_torch_tensor_memory_registers_and_round_trips(spawned: MooncakeStore) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when numpy is absent
        import torch

    layers = [torch.arange(i * 1000, i * 1000 + 4096, dtype=torch.int32) for i in range(3)]
    dst = torch.zeros(3 * 4096, dtype=torch.int32)
    tensors = [*layers, dst]
    for t in tensors:
        assert spawned.register_buffer(t.data_ptr(), t.nbytes) == 0
    try:
        config = spawned.new_replicate_config()
        codes = spawned.batch_put_from_multi_buffers(
            ["tensor"], [[t.data_ptr() for t in layers]], [[t.nbytes for t in layers]], config
        )
        assert codes == [0]
        assert spawned.batch_get_into_multi_buffers(["tensor"], [[dst.data_ptr()]], [[dst.nbytes]]) == [
            dst.nbytes
        ]
        assert torch.equal(dst, torch.cat(layers))
    finally:
        for t in tensors:
            assert spawned.unregister_buffer(t.data_ptr()) == 0


class _CountingClient:
    """The native client, noting each call that asks where objects lie."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.replica_asks: list[list[str]] = []

    def batch_get_replica_desc(self, keys: list[str]) -> Any:
        self.replica_asks.append(list(keys))
        return self._client.batch_get_replica_desc(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_lookups_ask_where_a_stored_object_lies_once_not_at_every_lookup(
    spawned: MooncakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    round_trip(spawned, "placed-once", b"kv")
    counting = _CountingClient(spawned._client)
    monkeypatch.setattr(spawned, "_client", counting)

    assert [spawned.batch_is_exist(["placed-once", "never-put"]) for _ in range(3)] == [[1, 0]] * 3
    assert counting.replica_asks == [["placed-once"]]  # only the present key, and only the first time


def test_after_close_every_call_returns_900_and_the_spawned_master_is_stopped() -> None:
    store = MooncakeStore.open(MooncakeSettings(global_segment_size="16MB", local_buffer_size=0))
    assert store.endpoints is not None
    port = store.endpoints.rpc_port
    buffer = ctypes.create_string_buffer(8)
    addr = ctypes.addressof(buffer)
    assert store.register_buffer(addr, 8) == 0
    store.close()
    store.close()  # idempotent
    assert store.closed and "closed" in repr(store)
    assert not is_listening("127.0.0.1", port)
    config = store.new_replicate_config()  # no client needed: still fine
    failed = Code.RPC_FAILED
    assert store.batch_is_exist(["a", "b"]) == [failed] * 2
    assert store.batch_put_from_multi_buffers(["a"], [[addr]], [[8]], config) == [failed]
    assert store.batch_get_into_multi_buffers(["a"], [[addr]], [[8]]) == [failed]
    assert store.batch_put_from(["a"], [addr], [8], config) == [failed]
    assert store.batch_get_into(["a"], [addr], [8]) == [failed]
    assert [store.get_size("a"), store.remove("a"), store.remove_all()] == [failed] * 3
    assert [store.register_buffer(addr, 8), store.unregister_buffer(addr)] == [failed] * 2


class _SlowClient:
    """A stand-in native client whose exist call blocks until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.closed_while_busy = False
        self.busy = False
        self.closes = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.busy = True
        self.entered.set()
        self.release.wait(5)
        self.busy = False
        return [1] * len(keys)

    def close(self) -> int:
        self.closed_while_busy |= self.busy
        self.closes += 1
        return 0


class _Config:
    group_ids: list[str] | None = None


def test_close_waits_for_calls_in_flight_before_closing_the_client() -> None:
    client = _SlowClient()
    store = MooncakeStore(
        client,
        _Config,
        settings=MooncakeSettings(),
        master=ResolvedMaster("127.0.0.1:1", "P2PHANDSHAKE"),
    )
    answers: list[list[int]] = []
    caller = threading.Thread(target=lambda: answers.append(store.batch_is_exist(["k"])))
    caller.start()
    assert client.entered.wait(5)
    closer = threading.Thread(target=store.close)
    closer.start()
    deadline = time.monotonic() + 5
    while not store.closed:  # close() has begun: it now waits for the call in flight
        assert time.monotonic() < deadline, "close() never began"
        time.sleep(0.001)
    assert closer.is_alive()  # still waiting: the call in flight holds it
    assert store.batch_is_exist(["k"]) == [Code.RPC_FAILED]  # closing: new calls are refused
    assert client.closes == 0
    client.release.set()
    caller.join(5)
    closer.join(5)
    assert answers == [[1]] and client.closes == 1 and not client.closed_while_busy


# -- a stopped master: the RPC deadline ------------------------------------------------------


def test_a_stopped_master_costs_a_call_rpc_timeout_ms_not_30_s_and_keys_survive() -> None:
    settings = MooncakeSettings(global_segment_size="16MB", local_buffer_size=0, rpc_timeout_ms=500)
    with MooncakeStore.open(settings) as store:
        assert store.spawned_master is not None
        harness.pause(store.spawned_master)
        try:
            started = time.monotonic()
            assert store.batch_is_exist(["a", "b"]) == [Code.RPC_TIMEOUT] * 2
            assert time.monotonic() - started < MASTER_RPC_WAIT_S / 3  # the 500 ms deadline, not the 30 s
        finally:
            harness.resume(store.spawned_master)
        assert store.batch_is_exist(["a"]) == [0]  # the master is back: answers again at once


def test_opening_a_store_leaves_the_rpc_timeout_environment_as_it_found_it() -> None:
    """Processes started later (an engine's workers) inherit it and would take ours for the user's."""
    assert "MC_RPC_TIMEOUT_MS" not in os.environ
    with MooncakeStore.open(MooncakeSettings(global_segment_size="16MB", rpc_timeout_ms=500)):
        assert "MC_RPC_TIMEOUT_MS" not in os.environ


@pytest.mark.mooncake
def test_open_shared_hands_out_one_client_per_settings_until_its_last_user_closes() -> None:
    with LocalMaster() as master:
        assert master.endpoints is not None
        settings = MooncakeSettings(
            master=master.endpoints.master_address, metadata_server="P2PHANDSHAKE", global_segment_size=0
        )
        first = MooncakeStore.open_shared(settings)
        second = MooncakeStore.open_shared(settings)
        assert second is first
        first.close()
        assert not second.closed and second.batch_is_exist(["shared-k"]) == [0]
        second.close()
        assert second.closed and second.batch_is_exist(["shared-k"]) == [Code.RPC_FAILED]
        third = MooncakeStore.open_shared(settings)  # a closed one is replaced
        assert third is not first
        third.close()
