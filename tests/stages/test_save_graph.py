"""The six stages wire into the default save graph and run under the real runtime."""

from pathlib import Path

import pytest
import yaml

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.pipeline import BuildError, Outcome, Pipeline, graph_from_yaml
from kvpipe.stages import DEFAULT_SAVE_PIPELINE, KV_STAGES, ObjectStatus, default_save_graph

from .kv_fixtures import FULL, RING, make_kv, make_request

SAVE_GRAPH = """
pipeline:
  stages:
    - {name: project, type: project}
    - {name: full, type: full, after: project.full}
    - {name: tail, type: tail, after: project.tail}
    - {name: group_ids, type: group_ids, after: [full, tail], params: {enable_group_semantics: FLAG}}
    - {name: filter, type: filter, after: group_ids, batch: {max_items: 64}}
    - {name: put, type: put, after: filter, batch: {max_items: 64}, params: {max_buffers_per_call: 4}}
"""


async def test_requests_saved_through_the_pipeline_end_ok_with_every_object_stored():
    kv = make_kv([FULL, RING, FULL], shards=2).kv  # two stored groups around one that is not
    store = MemoryStore()
    graph = graph_from_yaml(SAVE_GRAPH.replace("FLAG", "true"), KV_STAGES, {"kv": kv, "store": store})

    async with Pipeline(graph) as pipeline:
        jobs = [await pipeline.submit(make_request(kv, 40, request_id=f"req-{i}")) for i in range(3)]
        done = [await job.finished() for job in jobs]

    assert [(job.outcome, job.counts["put"]) for job in done] == [(Outcome.OK, 8)] * 3
    assert store.stats().objects == 3 * 8 * 2  # each with its seal
    assert store.stats().groups == 3 * 2  # one group per chunk, across both groups and shards


def test_a_misspelt_flag_in_yaml_is_a_build_error_naming_its_place():
    kv = make_kv().kv

    with pytest.raises(BuildError, match=r"stages\[3\]\.params\.enable_group_semantics: .*'flase'"):
        graph_from_yaml(SAVE_GRAPH.replace("FLAG", "flase"), KV_STAGES, {"kv": kv, "store": MemoryStore()})


def test_the_default_save_graph_is_the_one_in_configs():
    path = Path(__file__).parents[2] / "configs" / "save-pipeline.yaml"
    assert yaml.safe_load(path.read_text())["pipeline"] == DEFAULT_SAVE_PIPELINE


async def test_the_default_save_graph_saves_every_object_once_and_finds_them_existing_the_second_time():
    kv = make_kv([FULL, RING, FULL], shards=2).kv  # two stored groups around one that is not
    store = MemoryStore()
    graph = default_save_graph(kv, store, enable_group_semantics="true")
    assert graph.order[0] == "project" and graph.spec("filter").batch_policy.max_items == 256

    for expected in ("put", "existing"):
        async with Pipeline(default_save_graph(kv, store, enable_group_semantics=True)) as pipeline:
            job = await pipeline.submit(make_request(kv, 40, request_id="req"))
        assert (job.outcome, job.counts[expected], job.counts["considered"]) == (Outcome.OK, 8, 8)


async def test_an_observer_sees_every_object_once_with_its_final_status():
    kv = make_kv([FULL], shards=2).kv
    store = MemoryStore()
    seen: list[tuple[str, ObjectStatus]] = []
    observe = lambda record, status: seen.append((record.key, status))  # noqa: E731

    async with Pipeline(default_save_graph(kv, store, observer=observe)) as pipeline:
        await pipeline.submit(make_request(kv, 32, request_id="first"))
    first = dict(seen)
    seen.clear()
    async with Pipeline(default_save_graph(kv, store, observer=observe)) as pipeline:
        await pipeline.submit(make_request(kv, 48, request_id="first"))  # same prefix, one chunk more

    assert len(first) == 4 and set(first.values()) == {ObjectStatus.PUT}
    assert len(seen) == 6
    assert {key: status for key, status in seen if key in first} == {
        key: ObjectStatus.EXISTING for key in first
    }
