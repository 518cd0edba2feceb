"""YAML builds the same graphs, and its errors name the YAML path."""

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from kvpipe.pipeline import BuildError, Pipeline, StageRegistry, graph_from_yaml
from kvpipe.pipeline.config import load_yaml
from kvpipe.pipeline.registry import Resources

from .toy_stages import AddOne, Collect, RecordBatches

registry = StageRegistry()


class AddParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    amount: int = Field(1, gt=0)


class AddN(AddOne):
    def __init__(self, amount: int) -> None:
        self.amount = amount

    async def process(self, item, emit):
        await emit(item + self.amount)


@registry.register("add", AddParams)
def _add(params: AddParams, resources: Resources) -> AddN:
    return AddN(params.amount)


@registry.register("batch")
def _batch(params, resources) -> RecordBatches:
    return RecordBatches()


@registry.register("sink")
def _sink(params, resources) -> Collect:
    return resources["sink"]


GOOD = """
pipeline:
  stages:
    - name: first
      type: add
      params: {amount: 10}
    - name: gather
      type: batch
      after: first
      batch: {max_items: 4, max_wait_ms: 1}
    - name: end
      type: sink
      after: [gather]
"""


async def test_a_yaml_pipeline_builds_and_runs():
    sink = Collect()
    graph = graph_from_yaml(GOOD, registry, {"sink": sink})
    async with Pipeline(graph) as pipeline:
        for i in range(5):
            await pipeline.submit(i)
    assert sorted(sink.items) == [10, 11, 12, 13, 14]
    assert graph.spec("gather").batch_policy.max_items == 4


def test_a_yaml_file_on_disk_builds(tmp_path: Path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(GOOD)
    assert graph_from_yaml(path, registry, {"sink": Collect()}).entry == "first"


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("max_items: 4", "max_items: -1", "pipeline.stages[1].batch.max_items: must be > 0, got -1"),
        ("{amount: 10}", "{amount: 0}", "pipeline.stages[0].params.amount: must be > 0, got 0"),
        ("{amount: 10}", "{amont: 10}", "pipeline.stages[0].params.amont: is not a known field, got 10"),
        (
            "type: batch",
            "type: bach",
            "pipeline.stages[1].type: unknown stage type 'bach' (known: add, batch, sink)",
        ),
        (
            "after: first",
            "after: frist",
            "pipeline.stages[1]: stage 'gather': after 'frist': there is no stage 'frist'",
        ),
        (
            "after: [gather]",
            "after: [gather.tail]",
            "pipeline.stages[2]: stage 'end': after 'gather.tail': stage 'gather' has no port 'tail'",
        ),
        (
            "      type: add\n",
            "      type: add\n      workers: many\n",
            "pipeline.stages[0].workers: input should be a valid integer",
        ),
        ("    - name: end\n", "    - nme: end\n", "pipeline.stages[2].name: is required"),
        (
            "    - name: end\n",
            "    - name: first\n",
            "pipeline.stages[2]: stage 'first': two stages have this name",
        ),
    ],
)
def test_errors_name_the_yaml_path(old, new, message):
    assert old in GOOD
    with pytest.raises(BuildError) as error:
        graph_from_yaml(GOOD.replace(old, new), registry, {"sink": Collect()})
    assert message in str(error.value)


def test_a_missing_resource_is_named():
    with pytest.raises(
        BuildError, match=r"pipeline.stages\[2\] \(end\): resource 'sink' is needed but was not given"
    ):
        graph_from_yaml(GOOD, registry, {})


def test_malformed_yaml_is_a_build_error():
    with pytest.raises(BuildError, match="not valid YAML"):
        graph_from_yaml("pipeline: [unclosed", registry)


@pytest.mark.parametrize("value", ["2020-13-45", "!!int foo", "!!timestamp foo"])
def test_a_value_yaml_cannot_construct_is_a_build_error(value):
    with pytest.raises(BuildError, match=r"^YAML: not valid YAML: a value cannot be read \("):
        load_yaml(f"a: {value}")


def test_only_true_and_false_are_booleans():
    # YAML 1.1 would read ``off``/``on``/``yes``/``no`` as booleans: ``integrity: off`` is a word
    assert load_yaml("a: off\nb: on\nc: yes\nd: no\ne: true\nf: False\n") == {
        "a": "off",
        "b": "on",
        "c": "yes",
        "d": "no",
        "e": True,
        "f": False,
    }


def test_a_missing_file_is_a_build_error(tmp_path: Path):
    with pytest.raises(BuildError, match="no such file"):
        graph_from_yaml(tmp_path / "absent.yaml", registry)


def test_a_document_without_the_pipeline_section_is_a_build_error():
    with pytest.raises(BuildError, match="pipeline: is required"):
        graph_from_yaml("store: {}", registry)
