"""``kvpipe bench``: the performance suite, every figure a ratio measured in one run.

BENCHMARKS.md has how to run and read it, how long each workload takes and its
latest figures; this docstring says what each workload measures, not what it read.

Workloads (each a module with ``run(options) -> WorkloadResult``):

``local``
    Real Mooncake, puts into the client's own segment (the memcpy path), 2 MiB
    objects of a few buffers: the save pipeline against a raw loop of
    ``batch_is_exist`` + ``batch_put_from_multi_buffers`` over precomputed keys.
``tcp``
    The segment lives in another process, so every put crosses TCP loopback;
    64 KiB objects of 64 per-layer buffers: the pipeline (with gather staging)
    against the raw multi-buffer loop and a raw single-buffer put of the same bytes.
``small-requests``
    10,000 requests of 1-2 chunks, half already stored: the pipeline against the
    sequential per-request design and the same raw logic batched 64 requests a call.
``framework``
    Five no-op stages: items/s, and submit latency from a foreign thread.
``vllm``
    The real vLLM engine (the tiny 2-layer dummy Llama, and an 8-layer, 512-wide
    one where recompute costs more than a load), 32 requests over 8 shared
    1024-token system prompts, store then reset the prefix cache and reload:
    kvpipe's connector against vLLM's MooncakeStoreConnector and no connector.
    Hit tokens are the prompt tokens a connector spared from recompute.
``vllm-loads``
    The 8-layer model with requests decoding while others load a shared stored
    prefix: decode-step p50/p99 and time to first token, sync against async
    loads, and loads per shared prefix.
``vllm-layerwise``
    The 8-layer model (a 16k context), prompts of 1k, 4k and 16k tokens stored
    and reloaded after the prefix cache is reset: reload TTFT with sync, async and
    layer-wise loads against a local prefix-cache hit, the saves' landing after
    the forward (whole against layer-wise), and a layer-wise reload's timeline.
``save-visible``
    The 8-layer model kept busy (4 requests at all times): per chunk, the time
    from the step that computed it to another process's lookup finding it stored,
    at ``save_nice`` 10 (the default), 0 and 19.
``serve``
    A fleet (two ``vllm serve`` replicas behind vLLM's router over one store) under
    vLLM's own serving benchmark: a prefix-repetition and a multi-turn chat workload,
    no connector / vLLM's connector / kvpipe, policies round_robin, cache_aware and kv_aware:
    TTFT, ITL, hits by tier, chunks one replica loaded that the other stored.
``serve-pd`` (``serve --pd``)
    Prefill and decode on different engines through the store, vLLM's router in
    prefill/decode mode, under the same benchmark: kvpipe's split, vLLM's
    connector's split and the same engines as a plain kvpipe fleet: the share of
    the prompts' whole blocks the decode engine did not compute, TTFT, ITL.
``fragmentation``
    Partial-chunk bytes over live bytes as the store's capacity shrinks, with
    group semantics on and off (the shape of Mooncake RFC #2127's table).
``capacity``
    A skewed trace (Zipf-drawn shared prefixes, one-off documents) replayed against
    a real store of 0.25x-0.75x its working set: the hit rate of kvpipe with and
    without retention and of vLLM's connector's store calls, beside the best static
    choice and Belady's optimum; puts refused for space.
``capacity-engine``
    The ``capacity`` workload's targeted point (Zipf 1.0, half one-off, a store of
    0.5x the prefixes' KV) through real vLLM engines on the tiny model, vLLM's prefix
    cache reset between batches of 10 so every reuse is the store's: the hit rate of
    kvpipe with and without retention and of vLLM's connector, beside the best static
    choice and Belady's optimum.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from .result import BenchOptions, Target, WorkloadResult

__all__ = ["WORKLOADS", "BenchOptions", "Target", "WorkloadResult", "workload_runner"]

#: workload name -> the module (in this package) that runs it, in the suite's order
WORKLOADS: dict[str, str] = {
    "local": "local",
    "tcp": "tcp",
    "small-requests": "small_requests",
    "framework": "framework",
    "vllm": "vllm_prefix",
    "vllm-loads": "async_loads",
    "vllm-layerwise": "layerwise",
    "save-visible": "save_visible",
    "serve": "serve",
    "serve-pd": "serve_pd",
    "fragmentation": "fragmentation",
    "capacity": "capacity",
    "capacity-engine": "capacity_engine",
}


def workload_runner(name: str) -> Callable[[BenchOptions], WorkloadResult]:
    """The ``run`` function of workload ``name`` (imported on demand: some need vLLM)."""
    module = importlib.import_module(f"{__name__}.{WORKLOADS[name]}")
    # an imported-by-name module is untyped to mypy; every workload defines run(options)
    return cast("Callable[[BenchOptions], WorkloadResult]", module.run)
