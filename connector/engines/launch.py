"""Starting vLLM with a connector on a local master: what the demo, the bench, the fleet and the tests share.

Everything needed to run the real engine here without a download or a GPU: a dummy
model folder written from a config dict, the ``kv_transfer_config`` dicts of both
connectors (kvpipe's and vLLM's own ``MooncakeStoreConnector``) for one master, the
client that holds the store's memory, and one pass of greedy generation with the
figures a comparison needs.

vLLM is imported inside the functions that run it, so a process that only builds
configs and spawns engines (the bench's parent, a fleet) does not pay ~6 s for ``import vllm``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore
from kvpipe.connector.store.mooncake.master import MasterEndpoints
from kvpipe.stages.keys import is_object_key

if TYPE_CHECKING:
    from vllm.config.model import ModelDType  # for the annotation only: vLLM is imported where it runs


class StoreAddress(Protocol):
    """Where a store's clients connect: a master's endpoints, or an HA cluster's."""

    @property
    def master_address(self) -> str: ...

    @property
    def metadata_server(self) -> str: ...


#: vLLM's ``kv_load_failure_policy``: ``fail`` (its default) fails a request whose load
#: the store fails; ``recompute`` computes those blocks instead, what serving wants
LoadFailurePolicy = Literal["fail", "recompute"]
#: an engine's part in a prefill/decode split (vLLM's ``kv_role``): ``kv_both`` prefills (and serves prefix hits),
#: ``kv_consumer`` decodes and stores nothing
KVRole = Literal["kv_both", "kv_producer", "kv_consumer"]


#: The tiny 2-layer Llama: 64 KiB per 128-token block per layer, compute negligible.
#: (The CPU attention needs a head size in {32, 64, 80, ...}: hidden 128 / 4 heads = 32.)
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 1024,
}

#: A tiny DeepSeek-V2: MLA (one latent per token, ``CPU_MLA``), two dense layers.
#: vLLM's own prefix cache is off for it on CPU, so every reuse is a connector's.
TINY_DEEPSEEK_V2: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "first_k_dense_replace": 2,  # dense layers: the experts below are never built
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "n_shared_experts": 1,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

#: A tiny Qwen3-Next: GDN linear attention (three mamba groups, ``align`` mode) and one
#: full-attention group, overlaying one cache. (The CPU GDN kernel needs head dim 128.)
TINY_QWEN3_NEXT: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "full_attention_interval": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "max_position_embeddings": 4096,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
}
#: what the tiny models below share: 4 layers of 4 heads (2 KV heads of 32), a 1,024-token vocabulary
_SMALL_BODY: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
}
#: A tiny Qwen3: grouped-query attention (4 query heads over 2 KV heads, q/k norms), one KV-cache group.
TINY_QWEN3: dict[str, Any] = {**_SMALL_BODY, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
#: A tiny Gemma 3: sliding-window layers (a 256-token window) between full-attention ones,
#: two KV-cache groups; past its window a request's sliding-window blocks are the null block.
TINY_GEMMA3: dict[str, Any] = {
    **_SMALL_BODY,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "query_pre_attn_scalar": 32,
    "sliding_window": 256,
    "sliding_window_pattern": 2,
}
#: A tiny Gemma 4 (text) whose last two layers read the KV of the last earlier layer of their
#: kind (KV sharing: they have no KV cache of their own), sliding-window (the window of the
#: Gemma 3 above) and full-attention layers alternating: two groups. No per-layer inputs.
TINY_GEMMA4: dict[str, Any] = {
    **_SMALL_BODY,
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "global_head_dim": 32,
    "sliding_window": TINY_GEMMA3["sliding_window"],
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "num_kv_shared_layers": 2,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 1024,
}
#: A tiny Llama 4 (text): chunked local attention (256-token chunks) in three layers of four, the
#: fourth full attention without RoPE; four KV-cache groups. Before a position's chunk its
#: chunked groups' blocks are the null block. Dense MLPs: no layer is a mixture of experts.
TINY_LLAMA4: dict[str, Any] = {
    **_SMALL_BODY,
    "architectures": ["Llama4ForCausalLM"],
    "model_type": "llama4_text",
    "intermediate_size_mlp": 256,
    "attention_chunk_size": 256,
    "no_rope_layers": [1, 1, 1, 0],
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 0,
    "moe_layers": [],
    "use_qk_norm": False,
    "rope_scaling": None,
}
#: what a hybrid model needs to reuse a prefix at all: vLLM's prefix cache, mamba ``align``
HYBRID_ENGINE_ARGS: dict[str, Any] = {"enable_prefix_caching": True, "mamba_cache_mode": "align"}

#: vLLM metric counters (``llm.get_metrics()``, with ``disable_log_stats=False``) a pass reports.
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"


def model_dir(name: str, config: Mapping[str, Any], root: Path | None = None) -> Path:
    """A folder named ``name`` holding only ``config.json``: all vLLM needs with dummy weights.

    The folder's name is the model part of every store key, so it is kept as given;
    its parent is named by the config's hash, so equal configs share one folder and
    writing it again (another process, another test) is harmless.
    """
    text = json.dumps(dict(config), sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    folder = (root or Path(tempfile.gettempdir()) / "kvpipe-models") / digest / name
    target = folder / "config.json"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".config.json.{os.getpid()}"
        partial.write_text(text)
        partial.replace(target)  # atomic: a concurrent reader sees the whole file or none
    return folder


def kvpipe_transfer(
    extra: Mapping[str, Any], *, load_failure_policy: LoadFailurePolicy = "fail", kv_role: KVRole = "kv_both"
) -> dict[str, Any]:
    """``kv_transfer_config`` loading kvpipe's connector with ``extra`` as its settings."""
    return {
        "kv_connector": "KVPipeConnector",
        "kv_connector_module_path": "kvpipe.connector.vllm",
        "kv_role": kv_role,
        "kv_connector_extra_config": dict(extra),
        "kv_load_failure_policy": load_failure_policy,
    }


def mooncake_transfer(
    extra: Mapping[str, Any] | None = None,
    *,
    load_failure_policy: LoadFailurePolicy = "fail",
    kv_role: KVRole = "kv_both",
) -> dict[str, Any]:
    """``kv_transfer_config`` loading vLLM's own MooncakeStoreConnector (store from ``MOONCAKE_CONFIG_PATH``)."""
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": kv_role,
        "kv_connector_extra_config": dict(extra or {}),
        "kv_load_failure_policy": load_failure_policy,
    }


def store_section(endpoints: StoreAddress, global_segment_size: int | str = 0) -> dict[str, Any]:
    """kvpipe's ``store`` setting for a running master.

    ``global_segment_size=0`` makes the engine a pure client: its objects live in the
    segment of a :func:`segment_holder`, so they outlive the engine and every put and
    get crosses TCP, as with a store on other machines.
    """
    return {
        "kind": "mooncake",
        "master": endpoints.master_address,
        "metadata_server": endpoints.metadata_server,
        "global_segment_size": global_segment_size,
    }


def vllm_mooncake_config(endpoints: StoreAddress, global_segment_size: int | str = 0) -> dict[str, Any]:
    """The JSON that ``MOONCAKE_CONFIG_PATH`` names for vLLM's connector: the same master and mode."""
    return {
        "metadata_server": endpoints.metadata_server,
        "master_server_address": endpoints.master_address,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": global_segment_size,
        "local_buffer_size": "64MB",
        **({"mode": "standalone-store"} if global_segment_size in (0, "0") else {}),
    }


def vllm_mooncake_env(config_path: Path) -> dict[str, str]:
    """The environment vLLM's connector reads: its JSON, and a loopback host name for its client."""
    return {"MOONCAKE_CONFIG_PATH": str(config_path), "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}


def segment_holder(endpoints: MasterEndpoints, global_segment_size: int | str = "512MB") -> MooncakeStore:
    """A client that mounts the memory engines with ``global_segment_size=0`` store into."""
    # validated from a mapping: the field's validator parses a size string such as "512MB",
    # which the typed constructor (an int field) would not take
    return MooncakeStore.open(
        MooncakeSettings.model_validate(
            {
                "master": endpoints.master_address,
                "metadata_server": endpoints.metadata_server,
                "global_segment_size": global_segment_size,
            }
        )
    )


def stored_keys(endpoints: MasterEndpoints, *, seals: bool = False) -> list[str]:
    """The keys the master holds (its admin HTTP, as ``kvpipe inspect`` reads it).

    Seals and layer seals (kvpipe's metadata beside its objects) are left out unless ``seals``: what
    callers count is objects, whichever connector wrote them.
    """
    from kvpipe.connector.store.mooncake.admin import AdminClient

    keys = AdminClient(endpoints.host, endpoints.metrics_port).keys()
    return keys if seals else [key for key in keys if is_object_key(key)]


def make_llm(
    model: Path | str,
    transfer: Mapping[str, Any] | None,
    *,
    max_model_len: int = 1024,
    kv_cache_memory_bytes: int = 64 << 20,
    dtype: ModelDType = "bfloat16",
    **engine_args: Any,
) -> Any:
    """An engine on ``model`` with dummy weights (fixed seed: greedy outputs repeat across engines).

    Stats stay on so :func:`generate` can tell local prefix-cache hits from connector hits.
    ``engine_args`` go to ``LLM`` as they are (e.g. :data:`HYBRID_ENGINE_ARGS`).
    """
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=max_model_len,
        dtype=dtype,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        kv_transfer_config=KVTransferConfig(**transfer) if transfer else None,
        disable_log_stats=False,
        **engine_args,
    )


@dataclass(frozen=True)
class PassResult:
    """One :func:`generate` pass: per prompt its output and cached tokens, and pass totals.

    ``local_hits`` and ``connector_hits`` are the pass's increments of vLLM's own
    counters: prompt tokens served by the engine's prefix cache, and by the connector.
    """

    tokens: list[list[int]]
    cached: list[int]
    seconds: float
    local_hits: int
    connector_hits: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def greedy(max_tokens: int, **options: Any) -> Any:
    """The ``SamplingParams`` of every pass here: greedy, ``max_tokens`` tokens whatever EOS says, no text.

    ``options``: more of vLLM's sampling parameters (e.g. ``prompt_logprobs``).
    """
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False, **options)


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> PassResult:
    """One pass of greedy generation over ``prompts`` (token ids), timed."""
    before = counters(llm, PREFIX_CACHE_HITS, EXTERNAL_PREFIX_CACHE_HITS)
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": list(ids)} for ids in prompts], greedy(max_tokens), use_tqdm=False
    )
    seconds = time.perf_counter() - start
    after = counters(llm, PREFIX_CACHE_HITS, EXTERNAL_PREFIX_CACHE_HITS)
    return PassResult(
        tokens=[list(o.outputs[0].token_ids) for o in outputs],
        cached=[o.num_cached_tokens or 0 for o in outputs],
        seconds=round(seconds, 4),
        local_hits=after[PREFIX_CACHE_HITS] - before[PREFIX_CACHE_HITS],
        connector_hits=after[EXTERNAL_PREFIX_CACHE_HITS] - before[EXTERNAL_PREFIX_CACHE_HITS],
    )


def counters(llm: Any, *names: str) -> dict[str, int]:
    """vLLM's counters ``names`` as they stand (0 for one not reported yet; stats must be on)."""
    totals = dict.fromkeys(names, 0)
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += int(getattr(metric, "value", 0))
    return totals


def vllm_scheduler(llm: Any) -> Any:
    """An in-process engine's own scheduler (vLLM's: its requests, block pool, connector)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def connectors(llm: Any) -> tuple[Any, Any]:
    """An in-process engine's :class:`~kvpipe.connector.vllm.KVPipeConnector` pair: ``(scheduler, worker)``.

    The scheduler's is its engine core's; the worker's is vLLM's KV transfer agent,
    of which vLLM keeps one per process (an in-process engine's worker runs here).
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return vllm_scheduler(llm).connector, get_kv_transfer_group()


def sides(llm: Any) -> tuple[Any, Any]:
    """The role objects of :func:`connectors`: ``(SchedulerSide, WorkerSide)``, each present."""
    scheduler, worker = connectors(llm)
    assert scheduler.scheduler is not None and worker.worker is not None
    return scheduler.scheduler, worker.worker


def close_llm(llm: Any) -> None:
    """Shut an engine down now (its connector closes its store client), not at some later GC."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001, S110 - best effort; the object is dropped anyway
        pass
    del llm
    gc.collect()
