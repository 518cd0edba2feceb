"""The metrics catalogue is the one list: the sides count only under its names, the docs' table is it."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import pytest
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvpipe.connector.store.memory import MemoryStore
from kvpipe.connector.vllm import scheduler, worker
from kvpipe.connector.vllm.messages import KVPipeMetadata
from kvpipe.connector.vllm.metrics import (
    BY_NAME,
    CATALOGUE,
    LOADS_FAILED,
    LOADS_SYNC,
    SAVES_PLANNED,
    Side,
    markdown_table,
    metric_of,
)
from kvpipe.stages import LoadRequest, SaveRequest

from .test_kv_layout import engine_views
from .test_scheduler_side import BLOCK, PROMPT, make_harness, plan_saves
from .test_worker_side import HASHES, wait_finished
from .test_worker_side import worker as make_worker

PAGE = Path(__file__).parents[3] / "docs" / "vllm-connector.md"  # "Operating it": the metrics table


def unknown_to(side: Side, keys: Iterable[str]) -> set[str]:
    """The keys that name no catalogue metric this side reports."""
    return {key for key in keys if (found := metric_of(key)) is None or side not in found[0].side}


def test_catalogue_names_are_unique() -> None:
    assert len(BY_NAME) == len(CATALOGUE)


def test_every_key_the_scheduler_counts_is_a_scheduler_metric_of_the_catalogue() -> None:
    idle = make_harness()
    idle.store_chunks(4)
    request = idle.request("a")
    idle.admit(request)  # an idle engine: a sync load
    idle.step(scheduled={"a": PROMPT - 4 * BLOCK})
    idle.loads_ended(set(), blocks={10})  # its first block failed
    plan_saves(idle.side, request, PROMPT)
    assert {LOADS_SYNC, LOADS_FAILED, SAVES_PLANNED} <= set(idle.side.stats)
    assert unknown_to(Side.SCHEDULER, [*idle.side.stats, *idle.side.gauges()]) == set()


def test_every_key_the_worker_counts_is_a_worker_metric_of_the_catalogue() -> None:
    side = make_worker(MemoryStore(16 << 20), KVCacheLayout.LBHNC)
    side.register_kv_caches(engine_views(KVCacheLayout.LBHNC))
    save = SaveRequest("s", HASHES, ((4, 1, 5),), 3 * BLOCK)
    for _ in range(2):  # the second finds the objects there: existing, dropped by the filter
        side.wait_for_save(KVPipeMetadata(saves=[save]))
        assert side.drain(10.0)
    side.start_load_kv(KVPipeMetadata(loads=[LoadRequest("l", HASHES, ((0, 2, 3),), 0, 3 * BLOCK)]))
    assert wait_finished(side) == {"l"}
    gauges = side.gauges()
    side.shutdown(owns_store=False)
    assert {"objects_put", "objects_existing", "chunks_loaded", "stage_dropped/save/filter"} <= set(
        side.stats
    )
    assert unknown_to(Side.WORKER, [*side.stats, *gauges]) == set()


@pytest.mark.parametrize("module", [scheduler, worker], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_the_sides_spell_no_stats_key_out_as_a_string(module: ModuleType) -> None:
    """A literal key would bypass the catalogue; the names come from :mod:`.metrics`."""
    tree = ast.parse(Path(str(module.__file__)).read_text())
    spelled = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript)
        and ast.unparse(node.value) == "self.stats"
        and isinstance(node.slice, ast.Constant | ast.JoinedStr)
    ]
    assert spelled == []


def test_the_docs_metrics_table_is_the_catalogue() -> None:
    lines = PAGE.read_text().splitlines(keepends=True)
    start = lines.index(markdown_table().splitlines(keepends=True)[0])
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert "".join(lines[start:end]) == markdown_table(), "python -m kvpipe.connector.vllm.metrics prints it"
