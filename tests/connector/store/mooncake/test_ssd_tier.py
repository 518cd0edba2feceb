"""The SSD tier: a local-disk segment behind the memory one (Mooncake's offload on evict).

Each store here lends a 16 MiB memory segment and is given 24 MiB of objects, so at
least a third of them can only be on disk when every one is still found.
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from kvpipe.connector.cli.main import main
from kvpipe.connector.store.mooncake import MooncakeError, MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.cluster import LocalCluster
from kvpipe.connector.store.mooncake.master import LocalMaster
from kvpipe.connector.store.mooncake.settings import DiskTier
from kvpipe.stages.store import EXISTS, Code

ROOT = Path(__file__).resolve().parents[4]
OBJECT = 256 << 10
SEGMENT = 16 << 20
COUNT = 96  # 24 MiB of objects for a 16 MiB segment
KEYS = [f"ssd-{i}" for i in range(COUNT)]
PARTS = 4  # each object read into as many buffers, as a load reads a chunk's layers
READ_CALL = 16  # keys per get: 4 MiB, well within the 16 MiB read buffers below


def _value(i: int) -> bytes:
    return i.to_bytes(4, "little") * (OBJECT // 4)


@contextmanager
def _registered(store: MooncakeStore, nbytes: int) -> Iterator[int]:
    """A buffer of ``nbytes`` registered with ``store`` for the block; its address."""
    array = (ctypes.c_char * nbytes)()
    address = ctypes.addressof(array)
    assert store.register_buffer(address, nbytes) == 0
    try:
        yield address
    finally:
        store.unregister_buffer(address)


def _put_each(store: MooncakeStore, source: int) -> None:
    """Put every object, one call each: a full segment answers -200 until the master has made room."""
    for i, key in enumerate(KEYS):
        address = source + i * OBJECT
        ctypes.memmove(address, _value(i), OBJECT)
        deadline = time.monotonic() + 15
        while (codes := _put(store, key, address)) != [Code.OK]:
            assert codes == [Code.NO_SPACE] and time.monotonic() < deadline, (key, codes)
            time.sleep(0.05)


def _put(store: MooncakeStore, key: str, address: int) -> list[int]:
    return store.batch_put_from([key], [address], [OBJECT], store.new_replicate_config())


def _found(store: MooncakeStore, deadline_s: float) -> int:
    """How many objects the store finds, polled until all are or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while (found := store.batch_is_exist(KEYS).count(EXISTS)) < COUNT and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _read_back(store: MooncakeStore, target: int) -> list[bytes | int]:
    """Every object as the load path reads it (several buffers per key); its bytes or its error code."""
    part = OBJECT // PARTS
    read: list[bytes | int] = []
    for first in range(0, COUNT, READ_CALL):
        keys = KEYS[first : first + READ_CALL]
        ptrs = [[target + (first + k) * OBJECT + p * part for p in range(PARTS)] for k in range(len(keys))]
        results = store.batch_get_into_multi_buffers(keys, ptrs, [[part] * PARTS] * len(keys))
        for k, result in enumerate(results):
            start = target + (first + k) * OBJECT
            read.append(ctypes.string_at(start, OBJECT) if result == OBJECT else result)
    return read


def _bytes_under(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _tier(path: Path, size: str = "64MB") -> dict[str, object]:
    return {"path": path, "size": size, "read_buffer": "16MB"}


# -- settings (no processes) -----------------------------------------------------------------


def test_a_disk_tier_takes_sizes_as_the_other_sizes_and_an_absolute_folder(tmp_path: Path) -> None:
    disk = DiskTier(path=tmp_path / "a" / ".." / "disk", size="64GB")
    assert (disk.path, disk.size, disk.read_buffer) == (tmp_path / "disk", 64 << 30, 256 << 20)


def test_a_disk_tier_needs_a_memory_segment_in_front_of_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk\n  needs a memory segment in front of it"):
        MooncakeSettings(
            master="127.0.0.1:1", metadata_server="P2PHANDSHAKE", global_segment_size=0, disk=_tier(tmp_path)
        )


# -- a client with a disk tier, on a spawned master -------------------------------------------


@pytest.mark.mooncake
def test_objects_evicted_from_memory_are_found_on_disk_and_read_back_byte_identical(tmp_path: Path) -> None:
    settings = MooncakeSettings(
        global_segment_size=SEGMENT, local_buffer_size=0, lease_ttl_ms=100, disk=_tier(tmp_path / "disk")
    )
    with MooncakeStore.open(settings) as store:
        with _registered(store, COUNT * OBJECT) as source, _registered(store, COUNT * OBJECT) as target:
            _put_each(store, source)
            assert _found(store, deadline_s=10) == COUNT
            assert _read_back(store, target) == [_value(i) for i in range(COUNT)]
    assert _bytes_under(tmp_path / "disk") >= COUNT * OBJECT - SEGMENT


@pytest.mark.mooncake
def test_without_a_disk_tier_objects_evicted_from_memory_are_gone() -> None:
    settings = MooncakeSettings(global_segment_size=SEGMENT, local_buffer_size=0, lease_ttl_ms=100)
    with MooncakeStore.open(settings) as store, _registered(store, COUNT * OBJECT) as source:
        _put_each(store, source)
        assert store.batch_is_exist(KEYS).count(EXISTS) <= SEGMENT // OBJECT


@pytest.mark.mooncake
def test_a_disk_tier_on_a_master_that_does_not_offload_is_one_error_saying_how_to_start_it(
    tmp_path: Path,
) -> None:
    with LocalMaster() as master:
        assert master.endpoints is not None
        settings = MooncakeSettings(
            master=master.endpoints.master_address,
            metadata_server="P2PHANDSHAKE",
            global_segment_size=SEGMENT,
            disk=_tier(tmp_path / "disk"),
        )
        with pytest.raises(MooncakeError) as caught:
            MooncakeStore.open(settings)
    message = str(caught.value)
    assert "-1300" in message and "--enable_offload=true" in message and "\n" not in message


# -- kvpipe store --disk ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--disk", "{tmp}/disk"], "--disk: needs --disk-size SIZE, the most the disk tier holds"),
        (["--disk-size", "1GB"], "--disk-size: needs --disk DIR"),
        (["--disk", "{tmp}/file", "--disk-size", "1GB"], "--disk: is a file, not a folder, got {tmp}/file"),
        (
            ["--disk", "{tmp}/file/disk", "--disk-size", "1GB"],
            "--disk: cannot be created: {tmp}/file is a file",
        ),
        (["--disk", "{tmp}/disk", "--disk-size", "0"], "--disk-size: must be > 0 bytes, got '0'"),
        (["--disk", "{tmp}/disk", "--disk-size", "lots"], "--disk-size: must be a size such as"),
        (
            ["--disk", "{tmp}/disk", "--disk-size", "1GB", "--disk-read-buffer", "0"],
            "--disk-read-buffer: must be > 0 bytes, got '0'",
        ),
    ],
)
def test_bad_disk_flags_are_one_line_naming_the_flag_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    (tmp_path / "file").write_text("")
    assert main(["store", *(arg.format(tmp=tmp_path) for arg in args)]) == 2
    stderr = capsys.readouterr().err
    assert says.format(tmp=tmp_path) in stderr and stderr.count("\n") == 1, stderr
    assert not (tmp_path / "disk").exists()  # refused before anything started


@pytest.mark.mooncake
def test_a_store_node_with_a_disk_serves_engines_from_memory_and_disk(tmp_path: Path) -> None:
    disk = tmp_path / "node-disk"
    # the master's default lease (5 s) would stall these puts for seconds: see docs/ssd-tier.md
    with LocalMaster(enable_offload=True, lease_ttl_ms=100) as master:
        assert master.endpoints is not None
        node = subprocess.Popen(
            [
                sys.executable, "-m", "kvpipe.connector.cli.main", "store",
                "--master", master.endpoints.master_address, "--metadata-server", "P2PHANDSHAKE",
                "--segment", "16MB", "--disk", str(disk), "--disk-size", "64MB", "--disk-read-buffer", "16MB",
                "--json",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        try:
            assert node.stdout is not None
            ready = json.loads(node.stdout.readline())
            assert ready["disk"] == {"path": str(disk), "bytes": 64 << 20} and disk.is_dir()
            settings = MooncakeSettings.model_validate(
                {k: v for k, v in ready["kvpipe_store"].items() if k != "kind"}
            )
            with MooncakeStore.open(settings) as engine:  # no segment: the node's memory, then its disk
                with (
                    _registered(engine, COUNT * OBJECT) as source,
                    _registered(engine, COUNT * OBJECT) as target,
                ):
                    _put_each(engine, source)
                    assert _found(engine, deadline_s=10) == COUNT
                    assert _read_back(engine, target) == [_value(i) for i in range(COUNT)]
            assert _bytes_under(disk) >= COUNT * OBJECT - SEGMENT
            node.send_signal(signal.SIGTERM)
            assert node.wait(timeout=30) == 0
        finally:
            if node.poll() is None:
                node.kill()
                node.wait()


# -- LocalCluster -------------------------------------------------------------------------------


@pytest.mark.mooncake
def test_a_local_cluster_starts_store_nodes_with_disks_on_offloading_masters_and_removes_them() -> None:
    with LocalCluster(masters=1, store_nodes=1, node_disk="32MB") as cluster:
        [node] = cluster.store_nodes
        assert node.disk is not None and node.disk.size == 32 << 20 and node.disk.path.is_dir()
        [master] = cluster.masters
        assert master.pid is not None and "--enable_offload=true" in psutil.Process(master.pid).cmdline()
        node.kill()  # a lost machine (a stop of an HA node takes ~15 s): its folder goes with the cluster too
    assert not node.disk.path.exists()
