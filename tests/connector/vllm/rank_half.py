"""One TP rank's worker side in a process of its own: ``python -m tests.connector.vllm.rank_half SPEC_JSON``.

vLLM's CPU build cannot run TP=2 here (generation never finishes), so the tests
prove multi-rank behaviour with one worker half per process: each builds its
rank's KV views (its share of the KV heads, bytes that depend on the rank),
saves or loads one request through :class:`~kvpipe.connector.vllm.worker.WorkerSide`
on a real master, and prints one ``RESULT {json}`` line. It never imports vLLM
(~10 s): the step's metadata is the two fields the worker reads.

SPEC: ``tp_rank``, ``tp_size``, ``tp_replicas``, ``store`` (kvpipe's store
section), ``action`` (``"save"`` or ``"load"``), ``seed`` (the request's hashes),
optionally ``store_tp_size`` (objects sharded for that store TP size),
``dcp_size`` (the ranks are DCP ranks too: ``tp_rank % dcp_size``) and
``layerwise`` (the save or load runs in one step, layer by layer, as vLLM
drives a step's hooks with ``save_layerwise`` and ``load_layerwise``).
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

BLOCK = 16
CHUNKS = 3
LAYERS = ("layer.0", "layer.1")
HEADS = 4  # in all; each rank holds HEADS // tp_size, or all of them for a replicated latent


def views(tp_rank: int, tp_size: int, replicated: bool, fill: int | None) -> dict[str, torch.Tensor]:
    """Two layers of vLLM's CPU layout (LBHNC, one storage), ``[blocks, heads, 16, 64]`` bf16 each.

    A head's bytes are the same whichever TP size holds it (one model's KV, split
    by heads), so ranks of two TP sizes can check each other's. Made by hand rather
    than with vLLM's ``create_kv_cache_views``, so a rank's process does not pay
    ~10 s for ``import vllm``.
    """
    generator = torch.Generator().manual_seed(0)
    model = torch.randint(-128, 127, (2, 8, HEADS, BLOCK, 64 * 2), dtype=torch.int8, generator=generator)
    width = HEADS if replicated else HEADS // tp_size
    first = 0 if replicated else tp_rank * width
    raw = model[:, :, first : first + width].contiguous()
    if fill is not None:
        raw.fill_(fill)
    cache = raw.view(torch.bfloat16)
    return dict(zip(LAYERS, cache, strict=True))


def ranked_cache(tp_size: int, replicas: int = 1, store_tp_size: int | None = None, dcp_size: int = 1) -> Any:
    """The engine cache of the ranks' model at ``tp_size``, objects sharded if ``store_tp_size`` is given."""
    from .caches import engine_cache

    return engine_cache(
        LAYERS,
        num_blocks=8,
        model="ranked",
        tp_size=tp_size,
        tp_replicas=replicas,
        store_tp_size=store_tp_size,
        kv_heads=HEADS,
        dcp_size=dcp_size,
    )


def main(spec: dict[str, Any]) -> dict[str, Any]:
    from kvpipe.connector.vllm.engine_cache import open_store
    from kvpipe.connector.vllm.settings import settings_from
    from kvpipe.connector.vllm.worker import WorkerSide
    from kvpipe.stages import LoadRequest, SaveRequest

    from ...stages.kv_fixtures import chain_hashes
    from .vllm_step import run_step

    tp_rank, tp_size, replicas = spec["tp_rank"], spec["tp_size"], spec["tp_replicas"]
    layerwise = spec.get("layerwise", False)
    modes = {"load_layerwise": True, "save_layerwise": True, "load_async": False} if layerwise else {}
    settings = settings_from({"store": spec["store"], "enable_group_semantics": True, "staging_blocks": 8, **modes})
    cache = ranked_cache(tp_size, replicas, spec.get("store_tp_size"), spec.get("dcp_size", 1))
    store, _ = open_store(settings, mount_segment=False)
    side = WorkerSide(cache, settings, store, tp_rank)
    engine = views(tp_rank, tp_size, replicas > 1, fill=0 if spec["action"] == "load" else None)
    side.register_kv_caches(engine)
    hashes = chain_hashes(CHUNKS, salt=f"ranks-{spec['seed']}")
    blocks = ((2, 5, 7),)
    result: dict[str, Any] = {}
    if spec["action"] == "save":
        meta = SimpleNamespace(saves=[SaveRequest("r", hashes, blocks, CHUNKS * BLOCK)], loads=[], sync_loads=set())
        if layerwise:
            run_step(side, meta, LAYERS)
        else:
            side.wait_for_save(meta)
        assert side.drain(20.0)
        result["put"] = [(r.key, r.group_id) for r, status in side.observed if status.value == "put"]
    else:
        load = LoadRequest("r", hashes, blocks, 0, CHUNKS * BLOCK)
        if layerwise:
            run_step(side, SimpleNamespace(loads=[load], saves=[], sync_loads={"r"}), LAYERS)
        else:
            side.start_load_kv(SimpleNamespace(loads=[load], sync_loads=set()))
            deadline = time.monotonic() + 20
            while not side.get_finished() and time.monotonic() < deadline:
                time.sleep(0.01)
        expected = views(tp_rank, tp_size, replicas > 1, fill=None)
        result["failed_blocks"] = sorted(side.get_block_ids_with_load_errors())
        result["identical"] = all(
            torch.equal(engine[name][b].view(torch.int16), expected[name][b].view(torch.int16))
            for name in engine
            for b in blocks[0]
        )
    if layerwise:
        result["layered"] = side.stats["loads_layered"] + side.stats["saves_layered"]
    side.shutdown(owns_store=True)
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
