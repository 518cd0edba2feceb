"""``kvpipe run`` on the command line: output formats, overrides and bad input."""

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvpipe.connector.cli.main import main
from kvpipe.connector.run.engine import EngineTotals
from kvpipe.connector.run.report import ProgressLine

from ..run.test_job import SMALL

CONFIGS = Path(__file__).parents[3] / "configs"


@pytest.fixture
def small_config(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return path


def test_json_prints_one_json_object_on_stdout(small_config, capsys):
    assert main(["run", str(small_config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verify"]["mismatches"] == 0


def test_without_json_a_summary_table_is_printed(small_config, capsys):
    assert main(["run", str(small_config)]) == 0
    out = capsys.readouterr().out
    assert "verify" in out and "0 mismatches" in out and "filter" in out


def test_the_summary_headlines_the_pipelines_rate_and_names_the_generators_share(small_config, capsys):
    assert main(["run", str(small_config)]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^bytes put +[\d,]+: pipeline [\d.]+ GB/s \(bytes put / the [\d.]+ s run less the generator's [\d.]+ s of CPU\)$",
        out,
        re.MULTILINE,
    )
    assert re.search(
        r"^generator +[\d.]+ s \(CPU\) of the [\d.]+ s run \(\d+%\) writing [\d,]+ bytes", out, re.MULTILINE
    )


def test_set_overrides_a_yaml_value(small_config, capsys):
    assert main(["run", str(small_config), "--json", "--set", "workload.requests=7"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 7


def test_a_setting_whose_value_is_the_word_off_is_that_word(small_config, capsys):
    assert main(["run", str(small_config), "--json", "--set", "save.integrity=off"]) == 0
    assert json.loads(capsys.readouterr().out)["objects"]["failed"] == 0


def test_dump_objects_writes_one_json_line_per_object(small_config, tmp_path, capsys):
    dump = tmp_path / "objects.jsonl"
    assert main(["run", str(small_config), "--json", "--dump-objects", str(dump)]) == 0
    report = json.loads(capsys.readouterr().out)
    lines = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(lines) == report["objects"]["distinct_keys"]
    assert {tuple(sorted(line)) for line in lines} == {("group_id", "key", "size", "status")}
    assert {line["status"] for line in lines} <= {"put", "existing", "failed"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "model.layers=-1"], "model.layers: must be > 0, got -1"),
        (["--set", "model.layres=4"], "model.layres: is not a known field"),
        (
            ["--set", "save.enable_group_semantics=flase"],
            "save.enable_group_semantics: expected true or false, got 'flase'",
        ),
        (
            ["--set", "store.kind=redis"],
            "store: input tag 'redis' found using 'kind' does not match any of the expected tags",
        ),
        (["--set", "store.capacity=lots"], "store.capacity: must be a size such as"),
        (["--set", "parallel.tp_size=3"], "model.kv_heads (2) must be a multiple of parallel.tp_size (3)"),
        (
            ["--set", "workload.user_tokens=[9, 2]"],
            "user_tokens: must be [min, max] with 0 <= min <= max, got [9, 2]",
        ),
        (["--set", "model.layers"], "expected dotted.path=value"),
        (["--set", "model.num_blocks=4"], "model.num_blocks: 4 blocks cannot hold the longest request"),
        (["--set", "model.groups=[{kind: ring_buffer}]"], "no storable"),
        (["--set", "model.groups=[{kind: mamba}]"], "mamba"),
        (
            ["--set", "store={kind: mooncake, vllm_config: /no/such.json}"],
            "store: /no/such.json: cannot read the Mooncake config",
        ),
        (
            ["--dump-objects", "/no/such/folder/objects.jsonl"],
            "--dump-objects: folder '/no/such/folder' does not exist",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_field_and_exit_code_2(small_config, capsys, args, message):
    assert main(["run", str(small_config), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvpipe: error: ")
    assert message in captured.err
    assert captured.err.count("\n") == 1


def test_a_missing_config_file_is_exit_code_2(tmp_path, capsys):
    assert main(["run", str(tmp_path / "absent.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_malformed_yaml_is_exit_code_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed")
    assert main(["run", str(path)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_nothing_is_written_when_the_input_is_bad(small_config, tmp_path):
    dump = tmp_path / "objects.jsonl"
    assert main(["run", str(small_config), "--set", "model.layers=0", "--dump-objects", str(dump)]) == 2
    assert not dump.exists()


def test_the_console_script_prints_no_traceback_on_bad_input(small_config):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpipe.connector.cli.main",
            "run",
            str(small_config),
            "--set",
            "model.head_size=zero",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "model.head_size: input should be a valid integer" in result.stderr


@pytest.mark.parametrize("name", ["default.yaml", "hybrid.yaml"])
def test_the_shipped_memory_configs_validate(name, capsys):
    assert main(["run", str(CONFIGS / name), "--json", "--set", "workload.requests=5"]) == 0
    assert json.loads(capsys.readouterr().out)["verify"]["mismatches"] == 0


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_line_is_drawn_on_a_terminal_only():
    totals = EngineTotals(requests_finished=150)
    terminal, pipe = _Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = ProgressLine(stream)
        progress(totals, 300)
        progress.close()
    assert "150/300 requests" in terminal.getvalue() and "#" * 15 + "." * 15 in terminal.getvalue()
    assert pipe.getvalue() == ""
