"""``kvpipe store``: a store node as one command, and what it tells engines."""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.admin import AdminClient
from kvpipe.connector.store.mooncake.master_address import split_host_port
from kvpipe.connector.store.mooncake.segment_liveness import SegmentLiveness
from kvpipe.connector.store.mooncake.store_node import NodeReady

ROOT = Path(__file__).resolve().parents[4]
READY = NodeReady("127.0.0.1:12000", 64 << 20, "10.0.0.1:50051", "P2PHANDSHAKE", "tcp")


def _kvpipe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpipe.connector.cli.main", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--segment", "1MB"], "--segment: must be 0 (mount no segment) or at least 16 MiB"),
        (["--segment", "0"], "--segment: is 0 (mount no segment), but a spawned master"),
        (
            ["--master", "127.0.0.1:1", "--metadata-server", "P2PHANDSHAKE", "--segment", "0"],
            "--segment: a store node lends memory, so it must be at least 16 MiB, got '0'",
        ),
        (["--report-every", "0"], "--report-every: must be > 0 seconds, got 0"),
        (["--master-metrics", "nowhere"], "--master-metrics: must be"),
        (["--master", "zk://h:1", "--metadata-server", "P2PHANDSHAKE"], "--master: has scheme 'zk'"),
    ],
)
def test_bad_input_to_the_store_command_is_one_line_naming_the_flag(args: list[str], says: str) -> None:
    done = _kvpipe("store", *args)
    assert done.returncode == 2
    assert says in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_the_printed_vllm_json_is_a_config_vllms_connector_and_kvpipe_both_accept(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(READY.vllm_config()))
    settings = MooncakeSettings.from_vllm_file(path)
    assert (settings.master, settings.metadata_server, settings.global_segment_size) == (
        "10.0.0.1:50051",
        "P2PHANDSHAKE",
        0,
    )


def test_the_printed_store_block_mounts_no_segment() -> None:
    from kvpipe.connector.store.configs import MooncakeStoreConfig

    config = MooncakeStoreConfig.model_validate(READY.kvpipe_store())
    assert config.settings().global_segment_size == 0 and config.master == "10.0.0.1:50051"


def test_the_printed_store_block_names_the_masters_admin_http_the_node_knows() -> None:
    from dataclasses import replace

    from kvpipe.connector.store.configs import MooncakeStoreConfig

    ready = replace(READY, master_metrics=("10.0.0.1:9003",))
    config = MooncakeStoreConfig.model_validate(ready.kvpipe_store())
    assert config.master_metrics == ("10.0.0.1:9003",)


def test_replicas_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="replicas"):
        MooncakeSettings(replicas=0)


# -- segment liveness (no processes) ----------------------------------------------------------


class _Probes:
    def __init__(self, alive: bool) -> None:
        self.alive = alive
        self.calls: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int, timeout_s: float) -> bool:
        self.calls.append((host, port))
        return self.alive


def test_an_endpoint_is_probed_once_per_ttl() -> None:
    now = [0.0]
    probes = _Probes(alive=False)
    liveness = SegmentLiveness(ttl_s=1.0, probe=probes, clock=lambda: now[0], renew=lambda probe: probe())
    assert [liveness.alive("10.0.0.2:15000") for _ in range(3)] == [False] * 3
    now[0] = 1.5
    probes.alive = True
    liveness.alive("10.0.0.2:15000")  # expired: answered as it stood, probed again

    assert liveness.alive("10.0.0.2:15000") is True
    assert probes.calls == [("10.0.0.2", 15000)] * 2


def test_an_expired_answer_is_given_at_once_while_one_probe_renews_it_elsewhere() -> None:
    now = [0.0]
    probes = _Probes(alive=True)
    renewals: list = []
    liveness = SegmentLiveness(ttl_s=1.0, probe=probes, clock=lambda: now[0], renew=renewals.append)
    assert liveness.alive("10.0.0.2:15000") is True  # never seen: probed on the caller's thread
    now[0] = 1.5
    probes.alive = False  # the node is gone

    assert [liveness.alive("10.0.0.2:15000") for _ in range(3)] == [True] * 3  # nobody waited
    assert len(renewals) == 1 and len(probes.calls) == 1  # one probe on its way, not run here
    renewals[0]()
    assert liveness.alive("10.0.0.2:15000") is False


def test_closing_ends_the_thread_that_renews_answers() -> None:
    now = [0.0]
    others = set(threading.enumerate())  # stores this process keeps open renew in threads of their own
    liveness = SegmentLiveness(ttl_s=1.0, probe=_Probes(alive=True), clock=lambda: now[0])
    liveness.alive("10.0.0.2:15000")
    now[0] = 1.5
    liveness.alive("10.0.0.2:15000")  # renewed in its thread
    renewers = [t for t in threading.enumerate() if t.name == "kvpipe-liveness" and t not in others]
    assert renewers

    liveness.close()

    for thread in renewers:
        thread.join(10.0)
    assert not any(thread.is_alive() for thread in renewers)


def test_an_endpoint_that_cannot_be_probed_counts_as_alive() -> None:
    probes = _Probes(alive=False)
    liveness = SegmentLiveness(probe=probes)
    assert liveness.alive("") and liveness.alive("rdma-device-0") and probes.calls == []


def test_an_object_is_lost_when_any_of_its_places_is_a_node_that_does_not_answer() -> None:
    """A read may go to any of its replicas: one on a lost node makes the object unreadable."""
    liveness = SegmentLiveness(probe=lambda host, port, timeout: port == 2)
    places = {"live": ("h:2", "h:2"), "one-lost": ("h:2", "h:1"), "nowhere": ()}
    assert liveness.lost_keys(places, places.__getitem__) == {"one-lost"}


# -- the command on a real master -------------------------------------------------------------


@pytest.mark.mooncake
def test_a_store_node_serves_engines_reports_its_use_and_stops_on_sigterm() -> None:
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpipe.connector.cli.main",
            "store",
            "--segment",
            "32MB",
            "--json",
            "--report-every",
            "0.2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert node.stdout is not None
        ready = json.loads(node.stdout.readline())
        assert ready["event"] == "ready" and ready["segment_bytes"] == 32 << 20
        host, port = split_host_port(ready["master_metrics"][0])  # the spawned master's admin HTTP
        assert AdminClient(host, port).keys() == []  # it answers, and nothing is stored yet
        children = [child.pid for child in psutil.Process(node.pid).children(recursive=True)]
        assert children  # the master it spawned
        settings = MooncakeSettings.model_validate(
            {k: v for k, v in ready["kvpipe_store"].items() if k != "kind"}
        )
        value = bytearray(b"n" * (1 << 20))
        with MooncakeStore.open(settings) as engine:  # no segment: the object lands in the node's
            address = ctypes.addressof((ctypes.c_char * len(value)).from_buffer(value))
            assert engine.register_buffer(address, len(value)) == 0
            assert engine.batch_put_from(
                ["node-k"], [address], [len(value)], engine.new_replicate_config()
            ) == [0]
            used = 0
            deadline = time.monotonic() + 20
            while used < len(value) and time.monotonic() < deadline:
                line = json.loads(node.stdout.readline())
                if line["event"] == "segment":
                    used = line["used_bytes"]
            assert used >= len(value)
            engine.unregister_buffer(address)
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=30) == 0
        rest = [json.loads(line) for line in node.stdout.read().splitlines()]
        assert rest[-1]["event"] == "stopped"
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    assert not [
        pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    ]


@pytest.mark.mooncake
def test_a_node_whose_close_outlasts_its_deadline_still_stops_the_master_it_spawned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from kvpipe.connector.store.mooncake.store_node import serve

    real_close = MooncakeStore.close
    slow: list[MooncakeStore] = []

    def slow_close(store: MooncakeStore) -> None:  # an HA client's close waits ~30 s
        slow.append(store)
        time.sleep(1.0)

    monkeypatch.setattr(MooncakeStore, "close", slow_close)
    stop = threading.Event()
    masters: list[int] = []
    before = {child.pid for child in psutil.Process().children()}  # the session's own masters stay

    def ready(node: NodeReady) -> None:
        masters.extend(
            child.pid
            for child in psutil.Process().children()
            if child.pid not in before and "mooncake_master" in child.name()
        )
        stop.set()

    closed = serve(
        MooncakeSettings(global_segment_size="32MB"),
        stop=stop,
        on_ready=ready,
        on_use=lambda use: None,
        close_timeout_s=0.1,
    )
    assert closed is False and masters
    assert not [pid for pid in masters if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    time.sleep(1.0)
    real_close(slow[0])  # the close the node left to its thread, done here before the test ends
