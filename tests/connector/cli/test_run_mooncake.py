"""``kvpipe run`` on the real Mooncake store (masters spawned on loopback by the tests)."""

import contextlib
import io
import json
import time
from pathlib import Path

import pytest

from kvpipe.connector.cli.main import main
from kvpipe.connector.engines.launch import segment_holder
from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster, free_port

CONFIG = str(Path(__file__).parents[3] / "configs" / "mooncake.yaml")
SMALL = [
    "--set", "workload.requests=40",
    "--set", "workload.system_prompt_tokens=[32, 128]",
    "--set", "model.num_blocks=1024",
    "--set", "store.global_segment_size=64MB",
]  # fmt: skip


def _run(capsys, *args: str) -> dict:
    assert main(["run", CONFIG, "--json", *SMALL, *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_mooncake_config_saves_and_reads_back_intact_on_a_spawned_master(capsys):
    report = _run(capsys)

    assert report["store"]["kind"] == "mooncake"
    assert report["store"]["group_ids_supported"] is True
    assert report["objects"]["put"] > 0
    assert report["verify"]["mismatches"] == 0
    assert report["verify"]["missing"] == 0
    assert report["chunks"]["complete"] == report["chunks"]["total"]


def test_a_run_on_a_spawned_master_says_where_its_admin_http_is(capsys):
    """Where ``kvpipe inspect --metrics`` reads the keys while the run lasts."""
    assert main(["run", CONFIG, "--json", *SMALL]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kvpipe run: a master")]
    assert len(said) == 1 and " (admin HTTP 127.0.0.1:" in said[0]


def test_a_second_run_against_a_kept_store_finds_every_object_and_puts_none(capsys):
    """Objects live in the segments clients mount: a long-lived client holds the store's
    memory (as a dedicated store process does), the runs contribute none (segment 0)."""
    with LocalMaster() as master:
        endpoints = master.endpoints
        assert endpoints is not None
        kept = MooncakeSettings(
            master=endpoints.master_address,
            metadata_server=endpoints.metadata_server,
            global_segment_size="256MB",
        )
        with MooncakeStore.open(kept):
            client_only = [
                "--set", f"store.master={endpoints.master_address}",
                "--set", f"store.metadata_server={endpoints.metadata_server}",
                "--set", "store.global_segment_size=0",
            ]  # fmt: skip
            first = _run(capsys, *client_only)
            second = _run(capsys, *client_only)

    assert first["objects"]["put"] > 0
    assert second["objects"]["put"] == 0
    assert second["objects"]["existing"] == second["objects"]["considered"]
    assert second["verify"]["mismatches"] == 0


def _main_json(*args: str) -> dict:
    """``kvpipe ARGS`` (with --json): its report."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def sealed_run() -> tuple[dict, dict]:
    """Issue 55's commands: the shipped config as it is on a master whose objects a store node holds
    (``kvpipe store``), then ``kvpipe inspect --verify`` over all of them: the run's report and the verdicts."""
    with LocalMaster() as master:
        endpoints = master.endpoints
        assert endpoints is not None
        with segment_holder(endpoints, "256MB"):
            report = _main_json(
                "run", CONFIG, "--json",
                "--set", f"store.master={endpoints.master_address}",
                "--set", f"store.metadata_server={endpoints.metadata_server}",
                "--set", "store.global_segment_size=0",
            )  # fmt: skip
            inspected = _main_json(
                "inspect", "--json", "--verify", "--model", "synthetic-llama",
                "--master", endpoints.master_address,
                "--metadata-server", endpoints.metadata_server,
                "--metrics", f"{endpoints.host}:{endpoints.metrics_port}",
            )  # fmt: skip
    return report, inspected["verify"]


def test_after_a_run_the_scrubber_finds_every_object_on_the_master_sealed(sealed_run):
    report, verify = sealed_run

    objects = report["objects"]
    # every key the run offered, but those whose put the slow-store throttle skipped (a busy machine) or that failed
    assert objects["distinct_keys"] >= verify["objects"] >= objects["distinct_keys"] - objects["throttled"] - objects["failed"]
    assert verify["objects"] > 0
    assert [verify[verdict] for verdict in ("ok", "unverified", "corrupt", "unreadable")] == [verify["objects"], 0, 0, 0]


def test_a_run_on_the_master_reports_no_object_unsealed(sealed_run):
    report, _ = sealed_run

    assert report["objects"]["unsealed"] == 0


def test_group_semantics_on_the_real_store_give_every_object_its_chunks_group_id(capsys, tmp_path):
    dump = tmp_path / "objects.jsonl"
    report = _run(capsys, "--set", "save.enable_group_semantics=true", "--dump-objects", str(dump))
    lines = [json.loads(line) for line in dump.read_text().splitlines()]

    assert report["store"]["group_semantics"] is True
    assert all(
        line["group_id"] == f"vllm-mooncake-store:synthetic-llama@{line['key'].rsplit('@', 1)[1]}"
        for line in lines
    )


def test_an_unreachable_master_is_one_line_and_exit_code_2_within_seconds(capsys):
    nobody = free_port()
    started = time.monotonic()
    code = main(
        [
            "run", CONFIG,
            "--set", f"store.master=127.0.0.1:{nobody}",
            "--set", f"store.metadata_server=http://127.0.0.1:{nobody}/metadata",
            "--set", "store.connect_timeout_s=0.5",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert time.monotonic() - started < 10
    assert err.count("\n") == 1 and f"127.0.0.1:{nobody}" in err and "not reachable" in err


def test_the_json_file_vllm_users_have_configures_the_store(capsys, tmp_path):
    with LocalMaster() as master:
        endpoints = master.endpoints
        assert endpoints is not None
        config = tmp_path / "mooncake.json"
        config.write_text(
            json.dumps(
                {
                    "metadata_server": endpoints.metadata_server,
                    "master_server_address": endpoints.master_address,
                    "protocol": "tcp",
                    "device_name": "",
                    "global_segment_size": "64MB",
                    "local_buffer_size": "16MB",
                }
            )
        )
        report = _run(capsys, "--set", f"store={{kind: mooncake, vllm_config: {config}}}")

    assert report["store"]["kind"] == "mooncake"
    assert report["verify"]["mismatches"] == 0
