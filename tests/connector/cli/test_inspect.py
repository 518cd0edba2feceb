"""``kvpipe inspect`` on real masters: exact counts, the command's outputs, and bad input as one line.

A module master holds a known store: model ``alpha`` (two tp ranks x two store
groups, four chunks, the last missing one shard), ``alpha`` under another cache
prefix, model ``beta`` and two keys in no kvpipe format. Tests only read it; a
test that changes a store starts a master of its own.

``--verify`` tests each start a master with two store nodes holding model
``gamma``'s sealed objects (:data:`GAMMA`, random bytes, each with its seal).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvpipe.connector.cli.inspect import InspectError, ReportRequest, build_report, check_master
from kvpipe.connector.cli.inspect import verify as scrubber
from kvpipe.connector.cli.main import main
from kvpipe.connector.engines.launch import segment_holder
from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.admin import AdminClient, AdminError, find_admin
from kvpipe.connector.store.mooncake.cluster import LocalCluster
from kvpipe.connector.store.mooncake.master import LocalMaster, MasterEndpoints, free_port
from kvpipe.connector.store.mooncake.master_address import MasterAddress
from kvpipe.stages import KeyNamespace, group_id, object_key, seal_key
from kvpipe.stages.integrity import SEAL_SIZE, Seal, entry_of
from kvpipe.stages.keys import parse_object_key

pytestmark = pytest.mark.mooncake

ROOT = Path(__file__).resolve().parents[3]
SIZES = {0: 4096, 1: 1024}  # bytes per object of store group 0 and 1
HASHES = [bytes([n]) * 8 for n in range(4)]


def _alpha() -> dict[str, int]:
    """Four chunks of two store groups on two tp ranks; the last chunk lacks tp 1's group 1."""
    objects = {}
    for index, chunk_hash in enumerate(HASHES):
        for tp in (0, 1):
            for store_group, size in SIZES.items():
                if (index, tp, store_group) != (3, 1, 1):
                    objects[object_key(KeyNamespace("org/alpha", tp_rank=tp), store_group, chunk_hash)] = size
    return objects


ALPHA = _alpha()
TENANT = {object_key(KeyNamespace("alpha", "tenant"), 0, bytes([9, n])): 2048 for n in range(2)}
BETA = {object_key(KeyNamespace("beta"), 0, bytes([7, n])): 512 for n in range(3)}
FOREIGN = {"not-a-kvpipe-key": 100, "other/tool:key": 100}
ALL = {**ALPHA, **TENANT, **BETA, **FOREIGN}


@dataclass(frozen=True)
class Master:
    endpoints: MasterEndpoints

    @property
    def admin(self) -> str:
        return f"{self.endpoints.host}:{self.endpoints.metrics_port}"

    @property
    def client(self) -> AdminClient:
        return AdminClient(self.endpoints.host, self.endpoints.metrics_port)


@dataclass(frozen=True)
class Live(Master):
    segment: str


def _writer(endpoints: MasterEndpoints) -> MooncakeStore:
    """A client that mounts nothing: what it puts lives in the segment holder's memory."""
    settings = MooncakeSettings(
        master=endpoints.master_address,
        metadata_server=endpoints.metadata_server,
        global_segment_size=0,
        local_buffer_size="16MB",
    )
    return MooncakeStore.open(settings)


def _zeros(objects: Mapping[str, int]) -> dict[str, bytes]:
    return {key: bytes(size) for key, size in objects.items()}


def _put(store: MooncakeStore, objects: Mapping[str, bytes], group_ids: Sequence[str] | None = None) -> None:
    """Put each of ``objects`` (key -> its bytes) in one call."""
    sizes = [len(data) for data in objects.values()]
    buffer = ctypes.create_string_buffer(b"".join(objects.values()), sum(sizes))
    base = ctypes.addressof(buffer)
    assert store.register_buffer(base, len(buffer)) == 0
    try:
        config = store.new_replicate_config()
        if group_ids is not None:
            config.group_ids = list(group_ids)
        offsets = itertools.accumulate(sizes[:-1], initial=0)
        codes = store.batch_put_from_multi_buffers(
            list(objects), [[base + offset] for offset in offsets], [[size] for size in sizes], config
        )
        assert codes == [0] * len(objects)
    finally:
        store.unregister_buffer(base)


def _group_ids(objects: Mapping[str, int]) -> list[str]:
    ids = []
    for key in objects:
        parts = parse_object_key(key)
        ids.append("" if parts is None else group_id(parts.namespace, parts.chunk_hash))
    return ids


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with LocalMaster() as master:
        assert master.endpoints is not None
        with segment_holder(master.endpoints, "64MB") as holder, _writer(master.endpoints) as writer:
            _put(writer, _zeros(ALL), _group_ids(ALL))
            yield Live(master.endpoints, holder.hostname())


def _inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- the report ------------------------------------------------------------------------------


def test_the_report_counts_the_models_objects_bytes_and_chunks_exactly(live: Live) -> None:
    report = build_report(live.client, ReportRequest("org/alpha"))

    assert (report.model, report.cache_prefix) == ("alpha", "")
    assert report.objects == report.replicas == len(ALPHA) == 15
    assert report.bytes == sum(ALPHA.values())
    assert vars(report.chunks) == {"total": 4, "complete": 3, "partial": 1, "absent": 0}
    assert not report.absent_known and report.as_json()["chunks"]["absent"] is None
    assert report.complete_bytes == 3 * (2 * 4096 + 2 * 1024)
    assert report.partial_bytes == 2 * 4096 + 1024
    assert report.partial_ratio == pytest.approx(report.partial_bytes / report.bytes)
    assert report.per_store_group == {0: (8, 8 * 4096), 1: (7, 7 * 1024)}
    assert report.shard_source == "seen"
    assert report.store_groups_expected == [0, 1]
    assert report.ranks_expected == [(0, 0, 0, 0), (1, 0, 0, 0)]
    assert report.unexpected_objects == 0


def test_keys_of_other_models_prefixes_and_tools_are_counted_apart(live: Live) -> None:
    report = build_report(live.client, ReportRequest("alpha"))

    assert report.other_keys == len(TENANT) + len(BETA) + len(FOREIGN)
    assert report.unparsed_keys == len(FOREIGN)
    assert report.other_models == [("beta", "", 3), ("alpha", "tenant", 2)]


def test_another_cache_prefix_is_another_cache(live: Live) -> None:
    report = build_report(live.client, ReportRequest("alpha", "tenant"))

    assert report.objects == 2 and report.bytes == 2 * 2048
    assert vars(report.chunks) == {"total": 2, "complete": 2, "partial": 0, "absent": 0}
    assert report.other_keys == len(ALPHA) + len(BETA) + len(FOREIGN)


def test_more_expected_store_groups_make_every_chunk_partial(live: Live) -> None:
    report = build_report(live.client, ReportRequest("alpha", store_groups=3))

    assert report.shard_source == "flags" and report.store_groups_expected == [0, 1, 2]
    assert vars(report.chunks) == {"total": 4, "complete": 0, "partial": 4, "absent": 0}
    assert report.partial_bytes == report.bytes


def test_fewer_expected_ranks_leave_the_others_objects_unexpected(live: Live) -> None:
    report = build_report(live.client, ReportRequest("alpha", tp_ranks=1))

    assert report.ranks_expected == [(0, 0, 0, 0)]
    assert vars(report.chunks) == {"total": 4, "complete": 4, "partial": 0, "absent": 0}
    assert report.unexpected_objects == 7  # tp rank 1's
    assert report.unexpected_bytes == 4 * 4096 + 3 * 1024


def test_each_store_node_has_the_models_replicas_and_the_masters_use(live: Live) -> None:
    [node] = build_report(live.client, ReportRequest("alpha")).nodes

    assert node.segment == live.segment
    assert (node.replicas, node.bytes) == (15, sum(ALPHA.values()))
    assert node.partial_bytes == 2 * 4096 + 1024
    assert node.used_bytes == sum(ALL.values())  # every model's objects
    assert node.capacity_bytes == 64 << 20
    assert node.reachable is True


def test_group_ids_are_reported_as_supported_and_per_object_as_not_observable(live: Live) -> None:
    group_ids = build_report(live.client, ReportRequest("alpha")).as_json()["group_ids"]

    assert group_ids["client_supports"] is True
    assert group_ids["per_object"] is None
    assert "not observable" in group_ids["note"]


def test_inspecting_refreshes_no_lease() -> None:
    """The admin's batch query takes no read lease: inspecting does not change what is evicted next."""
    keys = {object_key(KeyNamespace("leased", tp_rank=0), 0, bytes([n])): 256 for n in range(3)}
    first, second, third = keys
    with LocalMaster(lease_ttl_ms=60_000) as master:
        assert master.endpoints is not None
        with segment_holder(master.endpoints, "16MB"), _writer(master.endpoints) as writer:
            _put(writer, _zeros(keys))
            admin = AdminClient(master.endpoints.host, master.endpoints.metrics_port)
            assert build_report(admin, ReportRequest("leased")).objects == 3
            assert writer.batch_is_exist([second]) == [1]  # a client's read takes a 60 s lease

            assert writer.remove(first) == 0  # inspected only: no lease
            assert writer.remove(second) == -706
            assert writer.remove(third) == 0


def test_an_unknown_model_names_the_models_the_store_holds(live: Live) -> None:
    with pytest.raises(InspectError) as raised:
        build_report(live.client, ReportRequest("gamma"))

    assert raised.value.field == "model"
    assert "'alpha'" in str(raised.value) and "'beta'" in str(raised.value)


def test_a_standby_masters_admin_is_passed_over_for_the_leaders(cluster: LocalCluster) -> None:
    leader = cluster.wait_for_leader(timeout_s=60)
    admins = [(m.endpoints.host, m.endpoints.metrics_port) for m in cluster.masters if m.endpoints]
    standbys = [admin for admin in admins if leader.endpoints and admin[1] != leader.endpoints.metrics_port]
    assert standbys, "the session cluster has two masters"

    check_master(MasterAddress.parse(cluster.master_address), timeout_s=2)
    chosen = find_admin([*standbys, *admins])
    assert leader.endpoints is not None and chosen.port == leader.endpoints.metrics_port
    with pytest.raises(AdminError, match="stands by"):
        find_admin(standbys)


# -- the command -----------------------------------------------------------------------------


def test_the_table_shows_the_counts(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _inspect(capsys, "--metrics", live.admin, "--model", "alpha")

    assert code == 0, err
    assert "chunks        4: 3 complete, 1 partial, absent unknown" in out
    assert "objects       15 (39.0 KiB)" in out
    assert "'beta' (prefix '') 3" in out
    assert live.segment in out


def test_json_is_the_reports_fields(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _inspect(
        capsys,
        "--master",
        live.endpoints.master_address,
        "--metrics",
        live.admin,
        "--model",
        "alpha",
        "--json",
    )

    assert code == 0, err
    report = json.loads(out)
    assert (
        report
        == build_report(live.client, ReportRequest("alpha", master=live.endpoints.master_address)).as_json()
    )
    assert report["chunks"] == {"total": 4, "complete": 3, "partial": 1, "absent": None}
    assert report["bytes_by_chunk"]["partial"] == 2 * 4096 + 1024
    assert [node["segment"] for node in report["nodes"]] == [live.segment]
    assert set(report) == {
        "admin", "master", "model", "cache_prefix", "objects", "bytes", "replicas", "other_keys",
        "other_models", "unparsed_keys", "shards", "chunks", "bytes_by_chunk", "unexpected_objects",
        "store_groups", "group_ids", "run", "nodes", "seals", "verify",
    }  # fmt: skip


def test_png_draws_the_report(live: Live, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    figure = tmp_path / "inspect.png"

    code, _, err = _inspect(capsys, "--metrics", live.admin, "--model", "alpha", "--png", str(figure))

    assert code == 0, err
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_master_can_come_from_a_run_config_or_vllms_json(
    live: Live, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = {"kind": "mooncake", "master": live.endpoints.master_address, "metadata_server": "P2PHANDSHAKE"}
    run_config = tmp_path / "run.yaml"
    run_config.write_text(yaml.safe_dump({"store": store}))
    vllm_json = tmp_path / "mooncake.json"
    vllm_json.write_text(
        json.dumps(
            {"master_server_address": live.endpoints.master_address, "metadata_server": "P2PHANDSHAKE"}
        )
    )
    for config in (run_config, vllm_json):
        code, out, err = _inspect(
            capsys, "--config", str(config), "--metrics", live.admin, "--model", "alpha", "--json"
        )
        assert code == 0, err
        assert json.loads(out)["master"] == live.endpoints.master_address


def _bad_inputs(live: Live, tmp_path: Path) -> list[tuple[list[str], str]]:
    nowhere = f"127.0.0.1:{free_port()}"
    memory = tmp_path / "memory.yaml"
    memory.write_text(yaml.safe_dump({"store": {"kind": "memory"}}))
    spawn = tmp_path / "spawn.yaml"
    spawn.write_text(yaml.safe_dump({"store": {"kind": "mooncake", "master": "spawn"}}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model": {"name": "alpha"}}))
    stale = tmp_path / "stale.yaml"
    stale.write_text(
        yaml.safe_dump({"store": {"kind": "mooncake", "master": nowhere, "metadata_server": "P2PHANDSHAKE"}})
    )
    here = ["--metrics", live.admin]
    master = live.endpoints.master_address
    return [
        (["--model", "gamma", *here], "--model: the store holds no object of model 'gamma'"),
        (here, "--model: is required"),
        (["--model", "a@b", *here], "--model: must hold no '@'"),
        (["--model", "alpha", "--metrics", nowhere], f"--metrics: no master admin HTTP answers at {nowhere}"),
        (["--model", "alpha", "--metrics", "no-port"], "--metrics: must be 'host:port'"),
        (["--model", "alpha"], "--metrics: is required"),
        (
            ["--model", "alpha", "--master", nowhere, *here],
            f"--master: mooncake master is not reachable at {nowhere}",
        ),
        (["--model", "alpha", "--master", "http://somewhere:1", *here], "--master: has scheme 'http'"),
        (["--model", "alpha", "--groups", "0", *here], "--groups: must be >= 1, got 0"),
        (["--model", "alpha", "--tp-ranks", "two", *here], "argument --tp-ranks: invalid int value: 'two'"),
        (["--model", "alpha", "--timeout", "0", *here], "--timeout: must be > 0 seconds"),
        (["--model", "alpha", "--png", "/no/such/folder/x.png", *here], "--png: folder '/no/such/folder'"),
        (["--model", "alpha", "--config", str(memory), *here], "store.kind: must be 'mooncake'"),
        (
            ["--model", "alpha", "--config", str(spawn), *here],
            "store.master: 'spawn' names no running master",
        ),
        (["--model", "alpha", "--config", str(broken), *here], "--config: "),
        (["--model", "alpha", "--config", str(memory), "--master", nowhere], "not allowed with argument"),
        (["--run", str(tmp_path / "absent.yaml"), *here], "--run: "),
        (["--run", str(stale), *here], f"--run: {stale}: store.master: mooncake master is not reachable"),
        (["--run", str(run), "--groups", "2", *here], "--groups: not with --run"),
        (["--run", str(run), "--model", "beta", *here], "--model: 'beta' is not the model of --run"),
        (["--run", str(run), "--cache-prefix", "x", *here], "--cache-prefix: 'x' is not the cache prefix"),
        (["--model", "alpha", "--repair", *here], "--repair: only with --verify"),
        (["--model", "alpha", "--verify", "--sample", "0", *here], "--sample: must be >= 1, got 0"),
        (["--model", "alpha", "--verify", *here], "--verify: needs the store's client settings"),
        (
            ["--model", "alpha", "--verify", "--master", "198.18.0.9:50051", *here],  # not on this machine
            "--metadata-server: is required",
        ),
        (
            ["--model", "alpha", "--verify", "--master", master, "--metadata-server", "x", *here],
            "--metadata-server: must be 'P2PHANDSHAKE' or a URL",
        ),
        (
            ["--model", "alpha", "--verify", "--run", str(run), "--metadata-server", "P2PHANDSHAKE", *here],
            "--metadata-server: only with --master",
        ),
    ]


def test_bad_input_is_one_line_naming_the_field_and_exit_code_2(
    live: Live, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for args, message in _bad_inputs(live, tmp_path):
        code, out, err = _inspect(capsys, *args)
        assert code == 2, args
        assert out == "", args
        assert err.startswith("kvpipe: error: ") and err.count("\n") == 1, err
        assert message in err, (args, err)


def test_a_master_on_this_machine_without_its_admin_given_is_found_by_its_own_flags(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    """kvpipe store, kvpipe fleet and ``master: spawn`` start masters on free admin ports, not 9003."""
    code, out, err = _inspect(capsys, "--master", live.endpoints.master_address, "--model", "alpha", "--json")

    assert (code, err) == (0, "")
    assert json.loads(out)["model"] == "alpha"


def test_verify_of_a_master_on_this_machine_reads_its_metadata_server_off_its_flags(
    live: Live, capsys: pytest.CaptureFixture[str]
) -> None:
    master = live.endpoints.master_address
    code, out, err = _inspect(capsys, "--master", master, "--model", "alpha", "--verify", "--json")

    assert code == 0, err
    assert json.loads(out)["verify"]["objects"] > 0


def test_the_console_script_fails_in_seconds_with_one_line_and_no_traceback(live: Live) -> None:
    for flag in ("--master", "--metrics"):
        nowhere = f"127.0.0.1:{free_port()}"
        admin = [] if flag == "--metrics" else ["--metrics", live.admin]
        args = ["--model", "alpha", *admin, flag, nowhere]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "kvpipe.connector.cli.main", "inspect", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert time.monotonic() - started < 30  # seconds, never the client's ~90 s set-up retry
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
        assert done.stderr.startswith(f"kvpipe: error: {flag}: ")


# -- after the main job -----------------------------------------------------------------------


def _run_config(endpoints: MasterEndpoints) -> dict:
    """A hybrid model on two tp ranks whose objects outlive the job (it mounts no segment)."""
    return {
        "store": {
            "kind": "mooncake",
            "master": endpoints.master_address,
            "metadata_server": endpoints.metadata_server,
            "global_segment_size": 0,
            "local_buffer_size": "16MB",
        },
        "model": {
            "name": "org/hybrid-tiny",
            "layers": 2,
            "kv_heads": 2,
            "head_size": 32,
            "block_size": 32,
            "hash_block_size": 16,
            "num_blocks": 512,
            "groups": [{"kind": "full_attention"}, {"kind": "mamba", "mamba_mode": "align"}],
        },
        "parallel": {"tp_size": 2},
        "workload": {
            "requests": 24,
            "system_prompt_tokens": [32, 128],
            "user_tokens": [8, 48],
            "output_tokens": [8, 24],
        },
        "save": {"enable_group_semantics": True, "cache_prefix": "inspect-run"},
    }


def _chunks(keys: Sequence[str]) -> dict[bytes, list[str]]:
    chunks: dict[bytes, list[str]] = {}
    for key in keys:
        parts = parse_object_key(key)
        assert parts is not None
        chunks.setdefault(parts.chunk_hash, []).append(key)
    return chunks


def test_inspect_with_the_run_config_counts_the_main_jobs_chunks_and_the_absent_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with LocalMaster() as master:
        assert master.endpoints is not None
        admin = f"{master.endpoints.host}:{master.endpoints.metrics_port}"
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(_run_config(master.endpoints)))
        dump = tmp_path / "objects.jsonl"
        with segment_holder(master.endpoints, "64MB"):
            done = subprocess.run(
                [sys.executable, "-m", "kvpipe.connector.cli.main", "run", str(config), "--json"]
                + ["--dump-objects", str(dump)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, done.stderr[-2000:]
            job = json.loads(done.stdout.strip().splitlines()[-1])
            keys = [json.loads(line)["key"] for line in dump.read_text().splitlines()]
            assert job["chunks"]["complete"] == job["chunks"]["total"] > 0

            code, out, err = _inspect(capsys, "--run", str(config), "--metrics", admin, "--json")
            assert code == 0, err
            report = json.loads(out)
            assert report["chunks"] == job["chunks"]  # the job's own count, from the store's listing
            assert (report["model"], report["cache_prefix"]) == ("hybrid-tiny", "inspect-run")
            assert report["objects"] == job["objects"]["distinct_keys"] == len(keys)
            assert report["master"] == master.endpoints.master_address  # from the run config's store
            assert report["shards"]["source"] == "run"
            assert report["run"] == {
                "config": str(config),
                "chunks": job["chunks"]["total"],
                "objects": len(keys),
                "size_mismatches": 0,
            }
            assert report["group_ids"]["run_requests"] is True
            assert report["unexpected_objects"] == 0

            # Without the run, a chunk is expected to have every shard seen: a chunk the
            # job stored no mamba state for (only where the engine's state stood) is partial.
            code, out, err = _inspect(
                capsys,
                "--metrics",
                admin,
                "--model",
                "hybrid-tiny",
                "--cache-prefix",
                "inspect-run",
                "--json",
            )
            assert code == 0, err
            chunks = _chunks(keys)
            most = max(len(members) for members in chunks.values())
            assert most == 4  # 2 store groups x 2 tp ranks
            short = sum(1 for members in chunks.values() if len(members) < most)
            assert json.loads(out)["chunks"] == {
                "total": len(chunks),
                "complete": len(chunks) - short,
                "partial": short,
                "absent": None,
            }

            # One chunk loses every object, another one of its objects.
            whole, cut = [members for members in chunks.values() if len(members) >= 2][:2]
            with _writer(master.endpoints) as writer:
                for key in [*whole, cut[0]]:
                    assert writer.remove(key, force=True) == 0
            code, out, err = _inspect(capsys, "--run", str(config), "--metrics", admin, "--json")
            assert code == 0, err
            after = json.loads(out)
            total = job["chunks"]["total"]
            assert after["chunks"] == {"total": total, "complete": total - 2, "partial": 1, "absent": 1}
            assert after["objects"] == len(keys) - len(whole) - 1


# -- verifying: the scrubber -----------------------------------------------------------------

FINGERPRINT = bytes(range(16))
GAMMA_HASHES = [bytes([0xA0 + n]) * 8 for n in range(3)]


def _gamma() -> dict[str, bytes]:
    """Three chunks of one store group on two tp ranks: six objects of random bytes."""
    draw = random.Random(7)
    return {
        object_key(KeyNamespace("gamma", tp_rank=tp), 0, chunk_hash): draw.randbytes(4096)
        for chunk_hash in GAMMA_HASHES
        for tp in (0, 1)
    }


GAMMA = _gamma()


def _sealed(objects: Mapping[str, bytes], fingerprint: bytes = FINGERPRINT) -> dict[str, bytes]:
    """``objects`` and their seals as kvpipe's save path puts a request's run of chunks: per rank and
    store group, one seal under the first object's key vouching for them all (by kvpipe's own functions)."""
    streams: dict[str, list[str]] = {}
    for key in objects:
        streams.setdefault(key.rsplit("@", 1)[0], []).append(key)
    seals = {}
    for keys in streams.values():
        copies = [ctypes.create_string_buffer(objects[key], len(objects[key])) for key in keys]
        entries = tuple(
            entry_of(key, [ctypes.addressof(copy)], [len(objects[key])]) for key, copy in zip(keys, copies, strict=True)
        )
        seals[seal_key(keys[0])] = Seal(fingerprint, entries).pack()
    return {**objects, **seals}


@dataclass(frozen=True)
class Sealed(Master):
    writer: MooncakeStore

    @property
    def verify_args(self) -> list[str]:
        """``kvpipe inspect --verify`` on ``gamma``, through --master."""
        return [
            "--master", self.endpoints.master_address,
            "--metadata-server", self.endpoints.metadata_server,
            "--metrics", self.admin,
            "--model", "gamma", "--verify",
        ]  # fmt: skip

    def endpoint_of(self, key: str) -> str:
        [replica] = self.client.replicas([key])[key]
        return replica.endpoint


@pytest.fixture
def sealed() -> Iterator[Sealed]:
    """A master of its own, two store nodes, and :data:`GAMMA` with its seals."""
    with LocalMaster() as master:
        assert master.endpoints is not None
        endpoints = master.endpoints
        with (
            segment_holder(endpoints, "16MB"),
            segment_holder(endpoints, "16MB"),
            _writer(endpoints) as writer,
        ):
            _put(writer, _sealed(GAMMA))
            yield Sealed(endpoints, writer)


def _scrubbed(capsys: pytest.CaptureFixture[str], store: Sealed, *args: str) -> tuple[dict, str]:
    """``kvpipe inspect --verify --json`` on ``gamma``: the report and stderr."""
    code, out, err = _inspect(capsys, *store.verify_args, "--json", *args)
    assert code == 0, err
    return json.loads(out), err


def _overwrite(store: Sealed, key: str) -> None:
    """Other bytes of the same size under ``key``, its seal left as it was."""
    assert store.writer.remove(key, force=True) == 0
    _put(store.writer, {key: random.Random(1).randbytes(len(GAMMA[key]))})


def test_a_seal_counts_as_a_seal_and_with_its_objects_model(sealed: Sealed) -> None:
    delta = {object_key(KeyNamespace("delta"), 0, b"\x0d" * 8): b"d" * 512}
    _put(sealed.writer, _sealed(delta))

    report = build_report(sealed.client, ReportRequest("gamma"))

    seals = 2  # one per tp rank: each vouches for its rank's three chunks
    assert (report.seals, report.seal_bytes) == (seals, seals * SEAL_SIZE)
    assert (report.objects, report.bytes) == (len(GAMMA), sum(map(len, GAMMA.values())))
    assert vars(report.chunks) == {"total": 3, "complete": 3, "partial": 0, "absent": 0}
    assert report.other_keys == 2 and report.unparsed_keys == 0
    assert report.other_models == [("delta", "", 2)]  # its object and its seal
    assert report.as_json()["seals"] == {"count": seals, "bytes": seals * SEAL_SIZE}
    assert report.verification is None and report.as_json()["verify"] is None


def test_verify_finds_every_sealed_object_ok(sealed: Sealed, capsys: pytest.CaptureFixture[str]) -> None:
    report, _ = _scrubbed(capsys, sealed)

    verify = report["verify"]
    assert (verify["objects"], verify["bytes"]) == (len(GAMMA), sum(map(len, GAMMA.values())))
    assert [verify[name] for name in ("ok", "corrupt", "unverified", "unreadable")] == [len(GAMMA), 0, 0, 0]
    assert verify["fingerprints"] == {FINGERPRINT.hex(): len(GAMMA)}
    assert verify["repair"] is None
    assert len(report["nodes"]) == 2
    assert sum(node["verify"]["ok"] for node in report["nodes"]) == len(GAMMA)


def test_an_overwritten_object_is_corrupt_on_its_node(
    sealed: Sealed, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = sorted(GAMMA)[2]
    _overwrite(sealed, damaged)

    report, _ = _scrubbed(capsys, sealed)

    verify = report["verify"]
    assert (verify["ok"], verify["corrupt"]) == (len(GAMMA) - 1, 1)
    assert verify["corrupt_keys"] == [damaged] and verify["corrupt_chunks"] == 1
    corrupt = {node["endpoint"]: node["verify"]["corrupt"] for node in report["nodes"]}
    assert corrupt[sealed.endpoint_of(damaged)] == 1 and sum(corrupt.values()) == 1


def test_an_unsealed_object_is_unverified(sealed: Sealed, capsys: pytest.CaptureFixture[str]) -> None:
    _put(sealed.writer, {object_key(KeyNamespace("gamma"), 0, b"\x0e" * 8): b"v" * 1024})  # as vLLM writes

    report, _ = _scrubbed(capsys, sealed)

    verify = report["verify"]
    assert (verify["ok"], verify["unverified"], verify["corrupt"]) == (len(GAMMA), 1, 0)
    assert verify["fingerprints"] == {FINGERPRINT.hex(): len(GAMMA)}


def test_repair_removes_the_corrupt_chunks_objects(sealed: Sealed, capsys: pytest.CaptureFixture[str]) -> None:
    chunk = [object_key(KeyNamespace("gamma", tp_rank=tp), 0, GAMMA_HASHES[1]) for tp in (0, 1)]
    _overwrite(sealed, chunk[1])

    repaired, _ = _scrubbed(capsys, sealed, "--repair")
    again, _ = _scrubbed(capsys, sealed)

    assert repaired["verify"]["repair"] == {"removed": 2, "failed": 0}  # its seals lie under chunk 0: they stay
    assert set(sealed.client.keys()) == set(_sealed(GAMMA)) - set(chunk)
    assert (again["verify"]["ok"], again["verify"]["corrupt"]) == (len(GAMMA) - 2, 0)


def test_repair_of_an_anchor_chunk_takes_its_seals(sealed: Sealed, capsys: pytest.CaptureFixture[str]) -> None:
    chunk = [object_key(KeyNamespace("gamma", tp_rank=tp), 0, GAMMA_HASHES[0]) for tp in (0, 1)]
    _overwrite(sealed, chunk[1])

    repaired, _ = _scrubbed(capsys, sealed, "--repair")
    again, _ = _scrubbed(capsys, sealed)

    assert repaired["verify"]["repair"] == {"removed": 4, "failed": 0}  # two objects, the two seals under them
    assert set(sealed.client.keys()) == set(GAMMA) - set(chunk)
    assert (again["verify"]["ok"], again["verify"]["unverified"]) == (0, len(GAMMA) - 2)


def test_a_damaged_seal_makes_its_anchor_corrupt_and_the_rest_of_its_span_unverified(
    sealed: Sealed, capsys: pytest.CaptureFixture[str]
) -> None:
    anchor = object_key(KeyNamespace("gamma", tp_rank=0), 0, GAMMA_HASHES[0])
    assert sealed.writer.remove(seal_key(anchor), force=True) == 0
    _put(sealed.writer, {seal_key(anchor): random.Random(2).randbytes(SEAL_SIZE)})

    report, _ = _scrubbed(capsys, sealed)

    verify = report["verify"]
    assert (verify["ok"], verify["corrupt"], verify["unverified"]) == (3, 1, 2)
    assert verify["corrupt_keys"] == [anchor]


@pytest.mark.parametrize("size", [48, 2 * SEAL_SIZE], ids=["smaller", "larger"])
def test_a_seal_of_another_size_is_another_kvpipes_its_span_unverified_and_repair_removes_nothing(
    sealed: Sealed, capsys: pytest.CaptureFixture[str], size: int
) -> None:
    anchor = object_key(KeyNamespace("gamma", tp_rank=0), 0, GAMMA_HASHES[0])
    assert sealed.writer.remove(seal_key(anchor), force=True) == 0
    _put(sealed.writer, {seal_key(anchor): random.Random(2).randbytes(size)})

    report, _ = _scrubbed(capsys, sealed, "--repair")

    verify = report["verify"]
    assert (verify["ok"], verify["corrupt"], verify["unverified"]) == (3, 0, 3)
    assert verify["repair"] == {"removed": 0, "failed": 0}


def test_sample_reads_that_many_objects(sealed: Sealed, capsys: pytest.CaptureFixture[str]) -> None:
    report, _ = _scrubbed(capsys, sealed, "--sample", "2")

    verify = report["verify"]
    assert (verify["sample"], verify["objects"], verify["ok"]) == (2, 2, 2)
    assert verify["bytes"] == 2 * 4096
    assert sum(sum(node["verify"].values()) for node in report["nodes"]) == 2


def test_a_long_scrub_reads_in_bounded_calls_and_reports_progress(
    sealed: Sealed, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scrubber, "SCRUB_CALL_BYTES", 2 * 4096)  # two objects a call
    monkeypatch.setattr(scrubber, "PROGRESS_EVERY", 2)

    report, err = _scrubbed(capsys, sealed)

    assert report["verify"]["ok"] == len(GAMMA)
    assert err.splitlines() == [f"kvpipe inspect: verified {n} of {len(GAMMA)} objects" for n in (2, 4, 6)]


def test_two_fingerprints_under_one_model_are_warned_of(
    sealed: Sealed, capsys: pytest.CaptureFixture[str]
) -> None:
    other = {object_key(KeyNamespace("gamma"), 0, b"\x0f" * 8): b"o" * 4096}
    _put(sealed.writer, _sealed(other, fingerprint=bytes(16)))

    code, out, err = _inspect(capsys, *sealed.verify_args)

    assert code == 0, err
    assert f"verified      {len(GAMMA) + 1} objects" in out
    assert f"fingerprints  {FINGERPRINT.hex()} {len(GAMMA)}; {bytes(16).hex()} 1" in out
    assert "WARNING       2 configuration fingerprints under one model name" in out


def test_verify_reads_through_the_store_a_config_names(
    sealed: Sealed, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    endpoints = sealed.endpoints
    config = tmp_path / "run.yaml"
    store = {
        "kind": "mooncake",
        "master": endpoints.master_address,
        "metadata_server": endpoints.metadata_server,
        "local_buffer_size": "16MB",
    }
    config.write_text(yaml.safe_dump({"store": store}))

    code, out, err = _inspect(
        capsys, "--config", str(config), "--metrics", sealed.admin, "--model", "gamma", "--verify", "--json"
    )

    assert code == 0, err
    assert json.loads(out)["verify"]["ok"] == len(GAMMA)


def test_sample_without_verify_is_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _inspect(
        capsys, "--metrics", f"127.0.0.1:{free_port()}", "--model", "gamma", "--sample", "2"
    )

    assert (code, out) == (2, "")
    assert (
        err
        == "kvpipe: error: --sample: only with --verify (inspect reads objects only to verify them), got 2\n"
    )
