"""Bad input: one line naming the field and the value, exit code 2, no traceback, nothing written.

Every row is one mistake a user can make, given to the real command line
(``kvpipe.connector.cli.main.main``) in a fresh working folder that holds ``run.yaml``
and an empty folder ``a-folder``; ``FREE_PORT`` in a row stands for a port nothing
listens on. The rows for ``kv_connector_extra_config`` go through the vLLM
connector's settings parser, without starting vLLM.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.connector.cli.main import main
from kvpipe.connector.store.mooncake.master import free_port
from kvpipe.connector.vllm.settings import settings_from
from kvpipe.stages import ConfigError

SMALL_RUN = "model: {layers: 2, kv_heads: 2, head_size: 32, num_blocks: 512}\nworkload: {requests: 4}\n"
UNREACHABLE_MASTER = (
    "store: {kind: mooncake, master: '127.0.0.1:FREE_PORT', "
    "metadata_server: 'http://127.0.0.1:FREE_PORT/metadata'}\n"
)


def run_set(assignment: str) -> list[str]:
    return ["run", "run.yaml", "--set", assignment]


def case(case_id: str, args: list[str], *words: str, yaml: str | bytes = SMALL_RUN) -> pytest.ParameterSet:
    """A bad command line (run in a folder holding ``run.yaml`` = ``yaml``) and what its error must say."""
    return pytest.param(yaml, args, words, id=case_id)


COMMAND_LINES = [
    # the YAML file itself
    case(
        "malformed-yaml",
        ["run", "run.yaml"],
        "run.yaml: not valid YAML: line 2, column 1",
        yaml="model: [2\n",
    ),
    case("yaml-not-utf8", ["run", "run.yaml"], "run.yaml: not valid YAML: not UTF-8", yaml=b"\xff\xfe model"),
    case(
        "yaml-section-twice",
        ["run", "run.yaml"],
        "run.yaml: not valid YAML",
        "duplicate key 'model'",
        yaml="model: {layers: 2}\nmodel: {layers: 3}\n",
    ),
    case(
        "yaml-a-list",
        ["run", "run.yaml"],
        "run.yaml: must be a mapping",
        "got a list",
        yaml="- store\n- model\n",
    ),
    case("missing-config-file", ["run", "absent.yaml"], "absent.yaml: no such file"),
    case("config-is-a-folder", ["run", "a-folder"], "a-folder: is a folder"),
    # unknown keys, one per section
    case("unknown-section", run_set("colour=red"), "colour: is not a known field", "got 'red'"),
    case(
        "unknown-store-key", run_set("store.capcity=1GB"), "store.capcity: is not a known field", "got '1GB'"
    ),
    case(
        "unknown-mooncake-key",
        run_set("store={kind: mooncake, colour: red}"),
        "store.colour: is not a known field",
        "got 'red'",
    ),
    case("unknown-model-key", run_set("model.layres=4"), "model.layres: is not a known field", "got 4"),
    case("unknown-group-key", run_set("model.groups=[{size: 2}]"), "model.groups[0].size: is not", "got 2"),
    case("unknown-parallel-key", run_set("parallel.pp_size=2"), "parallel.pp_size: is not a known", "got 2"),
    case("unknown-workload-key", run_set("workload.request=5"), "workload.request: is not a known", "got 5"),
    case("unknown-save-key", run_set("save.prefix=a"), "save.prefix: is not a known field", "got 'a'"),
    case(
        "unknown-pipeline-key",
        run_set("pipeline={stages: [{name: p, type: project, worker: 2}]}"),
        "pipeline.stages[0].worker: is not a known field, got 2",
    ),
    case(
        "several-problems",
        run_set("pipeline={stages: [{nme: p, type: project}]}"),
        "pipeline.stages[0].name: is required (and 1 more)",
    ),
    # wrong types
    case(
        "string-for-int",
        run_set("model.layers=four"),
        "model.layers: input should be a valid integer",
        "got 'four'",
    ),
    case(
        "bool-for-int",
        run_set("model.layers=true"),
        "model.layers: input should be a valid integer",
        "got True",
    ),
    case(
        "float-for-int", run_set("model.head_size=1.5"), "model.head_size: input should be a valid", "got 1.5"
    ),
    case(
        "list-for-flag", run_set("save.enable_group_semantics=[1]"), "save.enable_group_semantics:", "got [1]"
    ),
    case(
        "list-for-bool",
        run_set("store.group_ids_supported=[true]"),
        "store.group_ids_supported:",
        "got [True]",
    ),
    case(
        "int-for-range", run_set("workload.user_tokens=5"), "workload.user_tokens: input should be", "got 5"
    ),
    case(
        "string-for-groups",
        run_set("model.groups=mamba"),
        "model.groups: input should be a valid list",
        "'mamba'",
    ),
    case(
        "list-for-string", run_set("save.cache_prefix=[a]"), "save.cache_prefix: input should be", "got ['a']"
    ),
    case(
        "string-for-section", run_set("model=big"), "model: input should be a valid dictionary", "got 'big'"
    ),
    # negative and zero sizes and counts
    case("negative-layers", run_set("model.layers=-1"), "model.layers: must be > 0, got -1"),
    case("zero-requests", run_set("workload.requests=0"), "workload.requests: must be > 0, got 0"),
    case("one-block", run_set("model.num_blocks=1"), "model.num_blocks: must be > 1, got 1"),
    case("negative-capacity", run_set("store.capacity=-5"), "store.capacity: must be > 0, got -5"),
    case("zero-capacity", run_set("store.capacity=0MB"), "store.capacity: must be > 0, got '0MB'"),
    case(
        "negative-segment",
        run_set("store={kind: mooncake, global_segment_size: -1}"),
        "store.global_segment_size: must be 0",
        "got -1",
    ),
    case(
        "zero-connect-timeout",
        run_set("store={kind: mooncake, connect_timeout_s: 0}"),
        "store.connect_timeout_s: must be > 0",
        "got 0",
    ),
    case(
        "inverted-range", run_set("workload.user_tokens=[9, 2]"), "user_tokens: must be [min, max]", "[9, 2]"
    ),
    case("bad-size-unit", run_set("store.capacity=12XB"), "store.capacity: must be a size", "got '12XB'"),
    case(
        "bad-size-number",
        run_set("store={kind: mooncake, local_buffer_size: 1.2.3MB}"),
        "store.local_buffer_size: has no valid number",
        "got '1.2.3MB'",
    ),
    # values outside a fixed set
    case("unknown-store-kind", run_set("store.kind=redis"), "store: input tag 'redis' found using 'kind'"),
    case(
        "unknown-dtype", run_set("model.dtype=int8"), "model.dtype: input should be 'bfloat16'", "got 'int8'"
    ),
    case(
        "unknown-group-kind",
        run_set("model.groups=[{kind: banana}]"),
        "model.groups[0].kind: input should be 'full_attention'",
        "got 'banana'",
    ),
    case(
        "mamba-not-in-align-mode",
        run_set("model.groups=[{kind: full_attention}, {kind: mamba, mamba_mode: all}]"),
        "model.groups[1].mamba_mode: a mamba group's state can only be saved in mode 'align'",
        "got 'all'",
    ),
    case(
        "mamba-without-mode",
        run_set("model.groups=[{kind: mamba}]"),
        "model.groups[0].mamba_mode:",
        "got None",
    ),
    case(
        "unknown-when-full", run_set("save.when_full=explode"), "save.when_full: input should be", "'explode'"
    ),
    case("unknown-stage-type", run_set("pipeline={stages: [{name: a, type: b}]}"), "stages[0].type:", "'b'"),
    # KV caches kvpipe cannot save
    case(
        "only-a-ring-buffer",
        run_set("model.groups=[{kind: ring_buffer}]"),
        "model.groups: no storable KV-cache group",
        "got [{'kind': 'ring_buffer'}]",
    ),
    case(
        "tp-size-not-dividing-kv-heads",
        run_set("parallel.tp_size=3"),
        "run.yaml: model.kv_heads (2) must be a multiple of parallel.tp_size (3)",
    ),
    case(
        "hash-block-not-dividing",
        run_set("model.hash_block_size=5"),
        "model.hash_block_size: must divide",
        "got 5",
    ),
    case("too-few-blocks", run_set("model.num_blocks=4"), "model.num_blocks: 4 blocks cannot hold"),
    case(
        "number-for-text",
        run_set("save.cache_prefix=2024"),
        "save.cache_prefix: input should be a valid string, got 2024 (a number, not text: write it in quotes)",
    ),
    case(
        "store-smaller-than-an-object",
        run_set("store.capacity=1KB"),
        "store.capacity: 1,024 bytes cannot hold one object",
    ),
    # the store's whereabouts
    case(
        "existing-master-without-metadata",
        run_set("store={kind: mooncake, master: '127.0.0.1:5'}"),
        "store.metadata_server: is required with an existing master",
    ),
    case(
        "master-port-out-of-range",
        run_set("store={kind: mooncake, master: '127.0.0.1:99999', metadata_server: P2PHANDSHAKE}"),
        "store.master: must be 'host:port' with a port in 1..65535",
        "got '127.0.0.1:99999'",
    ),
    case(
        "unreachable-master",
        ["run", "run.yaml", "--set", "store.connect_timeout_s=0.2"],
        "store.master: mooncake master at 127.0.0.1:FREE_PORT is not reachable",
        yaml=UNREACHABLE_MASTER,
    ),
    case(
        "missing-vllm-mooncake-json",
        run_set("store={kind: mooncake, vllm_config: absent.json}"),
        "store: absent.json: cannot read the Mooncake config",
    ),
    # --set itself
    case(
        "set-through-a-value",
        run_set("model.layers.depth=2"),
        "--set 'model.layers.depth=2': model.layers is not",
    ),
    case(
        "set-bad-yaml-value",
        run_set("model.layers=[2"),
        "--set 'model.layers=[2': the value is not valid YAML",
    ),
    case("set-without-equals", run_set("model.layers"), "--set 'model.layers': expected dotted.path=value"),
    # files to write
    case(
        "dump-objects-into-missing-folder",
        ["run", "run.yaml", "--dump-objects", "absent/objects.jsonl"],
        "--dump-objects: folder 'absent' does not exist",
    ),
    case(
        "dump-objects-onto-a-folder",
        ["run", "run.yaml", "--dump-objects", "a-folder"],
        "--dump-objects: 'a-folder' is a folder",
    ),
    # arguments argparse refuses
    case("run-without-config", ["run"], "the following arguments are required: config"),
    case(
        "bench-repeats-not-a-number",
        ["bench", "--repeats", "x"],
        "argument --repeats: invalid int value: 'x'",
    ),
    # kvpipe bench
    case("bench-unknown-workload", ["bench", "nope"], "workload: unknown 'nope'"),
    case("bench-zero-repeats", ["bench", "--repeats", "0"], "--repeats: must be >= 1, got 0"),
    case("bench-out-is-a-file", ["bench", "--out", "run.yaml"], "--out: 'run.yaml' is a file"),
    case(
        "bench-markdown-into-missing-folder",
        ["bench", "--markdown", "absent/bench.md"],
        "--markdown: folder 'absent' does not exist",
    ),
    # kvpipe fleet
    case("fleet-no-replicas", ["fleet", "--replicas", "0"], "--replicas: ", "got 0"),
    case("fleet-store-nodes-zero", ["fleet", "--store-nodes", "0"], "--store-nodes: ", "got 0"),
    case(
        "fleet-model-without-config",
        ["fleet", "--model", "a-folder"],
        "--model: 'a-folder' holds no config.json",
    ),
    case(
        "fleet-prefill-without-decode",
        ["fleet", "--prefill", "1"],
        "--decode: a split needs prefill and decode engines, got prefill 1 and decode 0",
    ),
    case(
        "fleet-split-without-connector",
        ["fleet", "--prefill", "1", "--decode", "1", "--connector", "none"],
        "--connector: a prefill/decode split passes the KV cache through a connector, got none",
    ),
    case("bench-pd-without-serve", ["bench", "--pd", "local"], "--pd: a variant of the serve workload"),
    case(
        "fleet-unknown-policy",
        ["fleet", "--policy", "nearest"],
        "argument --policy: invalid choice: 'nearest'",
    ),
]


def files_under(folder: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None) under ``folder``, by relative path."""
    return {
        str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes()
        for path in folder.rglob("*")
    }


@pytest.mark.parametrize(("run_yaml", "args", "words"), COMMAND_LINES)
def test_bad_command_line_is_one_error_line_naming_field_and_value_and_exit_code_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    run_yaml: str | bytes,
    args: list[str],
    words: tuple[str, ...],
) -> None:
    port = str(free_port())
    monkeypatch.chdir(tmp_path)
    if isinstance(run_yaml, bytes):
        (tmp_path / "run.yaml").write_bytes(run_yaml)
    else:
        (tmp_path / "run.yaml").write_text(run_yaml.replace("FREE_PORT", port))
    (tmp_path / "a-folder").mkdir()
    before = files_under(tmp_path)

    exit_code = main(args)

    captured = capsys.readouterr()
    assert exit_code == 2
    assert "Traceback" not in captured.err
    assert captured.err.startswith("kvpipe: error: ")
    assert captured.err.count("\n") == 1 and captured.err.endswith("\n")
    for word in words:
        assert word.replace("FREE_PORT", port) in captured.err
    assert captured.out == ""
    assert files_under(tmp_path) == before


EXTRA_CONFIGS = [
    pytest.param(
        {"enable_group_semantics": "flase"}, "enable_group_semantics", "'flase'", id="misspelt-flag"
    ),
    pytest.param({"enable_group_semantics": 2}, "enable_group_semantics", "got 2", id="int-for-flag"),
    pytest.param({"staging_blocks": 0}, "staging_blocks", "got 0", id="zero-staging-blocks"),
    pytest.param({"queue_capacity": -1}, "queue_capacity", "got -1", id="negative-queue-capacity"),
    pytest.param({"max_buffers_per_call": "many"}, "max_buffers_per_call", "'many'", id="string-for-int"),
    pytest.param({"cache_prefix": ["a"]}, "cache_prefix", "['a']", id="list-for-string"),
    pytest.param(
        {"cache_prefix": 2024}, "cache_prefix", "got 2024 (a number, not text: write it in quotes)", id="number-for-string"
    ),
    pytest.param({"queue_capcity": 3}, "queue_capcity", "got 3", id="unknown-key"),
    pytest.param({"store": {"kind": "redis"}}, "store", "'redis'", id="unknown-store-kind"),
    pytest.param({"store": "memory"}, "store", "got 'memory'", id="string-for-store"),
    pytest.param({"store": {"capacity": "1GB"}}, "store", "needs its 'kind' field", id="store-without-kind"),
    pytest.param(
        {"store": {"kind": "memory", "capacity": "12XB"}}, "store.capacity", "'12XB'", id="bad-size"
    ),
    pytest.param(
        {"store": {"kind": "mooncake", "global_segment_size": -1}},
        "store.global_segment_size",
        "got -1",
        id="negative-segment",
    ),
    pytest.param(
        {"store": {"kind": "mooncake", "master": "nohost"}}, "store.master", "'nohost'", id="bad-master"
    ),
    pytest.param({"config": "absent.yaml"}, "config", "absent.yaml: no such file", id="missing-config-file"),
    pytest.param({"config": "a-folder"}, "config", "a-folder: is a folder", id="config-is-a-folder"),
    pytest.param(
        {"config": "malformed.yaml"}, "config", "malformed.yaml: not valid YAML", id="malformed-yaml"
    ),
    pytest.param({"config": "a-list.yaml"}, "config", "'a-list.yaml' must hold a mapping", id="yaml-a-list"),
    pytest.param(
        {"config": "save-a-list.yaml"},
        "config",
        "save",
        id="save-section-a-list",
    ),
    pytest.param(
        {"staging_blocks": 0, "queue_capacity": 0},
        "queue_capacity",
        "got 0",
        id="two-bad-keys",
    ),
]


@pytest.mark.parametrize(("extra", "field", "value"), EXTRA_CONFIGS)
def test_bad_extra_config_is_one_line_naming_field_and_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, object], field: str, value: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "malformed.yaml").write_text("store: [memory\n")
    (tmp_path / "a-list.yaml").write_text("- store\n")
    (tmp_path / "save-a-list.yaml").write_text("save: [queue_capacity]\n")

    with pytest.raises(ConfigError) as error:
        settings_from(extra)

    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"kv_connector_extra_config.{field}: ")
    assert value in message
