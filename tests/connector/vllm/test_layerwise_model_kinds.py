"""Layer by layer on GQA, MLA and a hybrid model, in the real engine on a real master, one cache with vLLM's connector.

- GQA (a tiny Qwen3: 4 query heads over 2 KV heads) and MLA (the tiny DeepSeek-V2 on
  ``CPU_MLA``, one latent per token) have one KV-cache group: with ``load_async: false``
  every load runs in its request's step and is read layer by layer, each layer checked
  before its attention; saves are written layer by layer as the forward computes them.
- The hybrid (the tiny Qwen3-Next: three mamba groups and one attention group) saves layer
  by layer (a mamba layer's state is written with the next attention layer's, or at the
  step's end); its loads stay asynchronous and whole: vLLM 0.32 takes a failed load of a
  model with several KV-cache groups only from an async load, so no load of it can run
  in its request's step (docs/layerwise.md).

Each kind: kvpipe's layer-wise objects are loaded by vLLM's ``MooncakeStoreConnector``
(in a process of its own) and vLLM's are loaded by kvpipe, outputs equal both ways; what
kvpipe writes layer by layer is byte for byte what vLLM's connector wrote whole; and an
object whose last layers were damaged in the store is caught and recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_cache_interface import MambaSpec

from kvpipe.connector.engines import launch
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster
from kvpipe.stages.keys import parse_object_key

from . import engine
from .conftest import stored_keys, wait_for_keys
from .kinds import CPU_MLA, ENGINE, GQA, HYBRID, MAX_TOKENS, Engine, Kind, prompts, vllm_connector


@pytest.fixture(scope="module", params=[GQA, CPU_MLA, HYBRID], ids=lambda kind: kind.name)
def kvpipe(request: pytest.FixtureRequest, store_section: dict[str, Any]) -> Iterator[Engine]:
    kind: Kind = request.param
    # several groups: vLLM 0.32 takes their failed loads only from async ones
    layerwise = engine.LAYERWISE if kind.groups == 1 else {**engine.LAYERWISE, "load_async": True}
    transfer = launch.kvpipe_transfer({"store": store_section, **layerwise}, load_failure_policy="recompute")
    llm = launch.make_llm(kind.model, transfer, **ENGINE, **kind.engine_args)
    yield Engine(kind, llm)
    launch.close_llm(llm)


def _layered_loads(kvpipe: Engine) -> int:
    """The layer-wise loads a batch of two hits makes: one per prompt, where loads run in their step."""
    return 2 if kvpipe.kind.groups == 1 else 0


def _contents(kvpipe: Engine, objects: dict[str, bytes]) -> dict[str, bytes]:
    """``objects`` without what follows a mamba state in its page.

    A hybrid's pages are sized for an attention block; a state is shorter, and the
    rest of its page holds whatever the page held before: stored as it is, by vLLM's
    connector and by kvpipe alike, and different with each page's history.
    """
    vllm_groups = launch.vllm_scheduler(kvpipe.llm).kv_cache_config.kv_cache_groups
    specs = {
        group.store_group: vllm_groups[group.engine_group].kv_cache_spec
        for group in engine.worker(kvpipe.llm).cache.store_groups
    }
    contents = {}
    for key, value in objects.items():
        parts = parse_object_key(key)
        assert parts is not None
        spec = specs[parts.store_group]
        contents[key] = value[: spec.state_content_size_bytes] if isinstance(spec, MambaSpec) else value
    return contents


def test_objects_moved_layer_by_layer_are_interchangeable_with_vllms_connector(
    kvpipe: Engine, master: LocalMaster, holder: MooncakeStore, mooncake_json: Path
) -> None:
    ours, theirs = prompts(81), prompts(82)
    stored, records = engine.stored_by(kvpipe.llm, ours)
    assert engine.worker(kvpipe.llm).stats["saves_layered"] >= 2
    assert len({record.key for record in records}) == 2 * kvpipe.objects_per_prompt

    before = set(stored_keys(master))
    gen = [{"generate": batch, "max_tokens": MAX_TOKENS} for batch in (ours, theirs)]
    hit, own, _ = vllm_connector(kvpipe.kind, mooncake_json, [*gen, {"sleep": 1}])
    assert hit["cached"] == [kvpipe.full_hit] * 2
    assert hit["tokens"] == stored["tokens"]
    assert own["cached"] == [0, 0]
    written_by_vllm = sorted(set(wait_for_keys(master, len(before) + 2 * kvpipe.objects_per_prompt)) - before)
    assert len(written_by_vllm) == 2 * kvpipe.objects_per_prompt

    back, counts = engine.rerun(kvpipe.llm, theirs)
    assert back["cached"] == [kvpipe.full_hit] * 2
    assert back["tokens"] == own["tokens"]
    assert counts["loads_layered"] == _layered_loads(kvpipe)
    assert counts["chunks_unverified"] == 2 * kvpipe.loads_per_prompt  # vLLM's connector writes no seals

    # the same prompts computed again and saved by kvpipe, layer by layer, over vLLM's objects removed
    vllms_bytes = engine.objects(holder, written_by_vllm)
    for key in written_by_vllm:
        assert holder.remove(key, force=True) == 0
    again, counts = engine.rerun(kvpipe.llm, theirs)
    assert again["cached"] == [0, 0]
    assert counts["saves_layered"] >= 2
    assert _contents(kvpipe, engine.objects(holder, written_by_vllm)) == _contents(kvpipe, vllms_bytes)


def test_objects_whose_last_layers_were_damaged_are_caught_and_recomputed(
    kvpipe: Engine, holder: MooncakeStore
) -> None:
    """Each object's second half other bytes, its seals intact: the tokens equal those computed without a hit."""
    batch = prompts(83)
    stored, records = engine.stored_by(kvpipe.llm, batch)
    for key in dict.fromkeys(record.key for record in records):
        value = engine.read(holder, key, holder.get_size(key))
        value[value.numel() // 2 :] ^= 0xFF
        engine.overwrite(holder, [key], value)

    again, counts = engine.rerun(kvpipe.llm, batch)

    assert again["tokens"] == stored["tokens"]
    assert counts["loads_layered"] == _layered_loads(kvpipe)
    assert counts["integrity_failures_corrupt"] >= 1
    assert counts["chunks_loaded"] == 0
