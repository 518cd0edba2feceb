"""kvpipe as vLLM's KV connector: the tiny model twice, the second pass served from Mooncake.

    make vllm-demo          (or: .venv/bin/python examples/vllm_demo.py)

Spawns a local mooncake_master on free loopback ports and a client that holds the
store's memory (as a dedicated store process would), then runs the same prompts
twice through vLLM with KVPipeConnector, clearing vLLM's own prefix cache in
between, so every prefix hit of the second pass comes from the store. Prints the
hits and both passes' wall times. CPU only, dummy weights, no download.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 1024,
}


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import json

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvpipe.connector.master import LocalMaster
    from kvpipe.connector.mooncake import MooncakeSettings, MooncakeStore

    model_dir = Path(tempfile.mkdtemp(prefix="kvpipe-demo-")) / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    rng = random.Random(0)
    shared = [rng.randrange(1024) for _ in range(768)]  # a system prompt all requests share
    prompts = [{"prompt_token_ids": shared + [rng.randrange(1024) for _ in range(200)]} for _ in range(8)]
    sampling = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, detokenize=False)

    with LocalMaster() as master:
        assert master.endpoints is not None
        store = {
            "kind": "mooncake",
            "master": master.endpoints.master_address,
            "metadata_server": master.endpoints.metadata_server,
            "global_segment_size": 0,  # the engine is a pure client; the holder below has the memory
        }
        holder = MooncakeSettings(
            master=master.endpoints.master_address,
            metadata_server=master.endpoints.metadata_server,
            global_segment_size="512MB",
        )
        with MooncakeStore.open(holder):
            llm = LLM(
                model=str(model_dir),
                load_format="dummy",
                skip_tokenizer_init=True,
                enforce_eager=True,
                max_model_len=2048,
                dtype="bfloat16",
                kv_cache_memory_bytes=64 << 20,
                disable_log_stats=False,
                kv_transfer_config=KVTransferConfig(
                    kv_connector="KVPipeConnector",
                    kv_connector_module_path="kvpipe.connector.vllm",
                    kv_role="kv_both",
                    kv_connector_extra_config={"store": store},
                ),
            )
            passes = []
            for name in ("pass 1 (stores)", "pass 2 (loads)"):
                started = time.perf_counter()
                outputs = llm.generate(prompts, sampling)
                elapsed = time.perf_counter() - started
                hits = sum(o.num_cached_tokens or 0 for o in outputs)
                passes.append((name, elapsed, hits, [o.outputs[0].token_ids for o in outputs]))
                llm.reset_prefix_cache()
            del llm

    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    print(f"\n{'':16} {'wall s':>8} {'cached tokens':>14} (of {prompt_tokens:,} prompt tokens)")
    for name, elapsed, hits, _ in passes:
        print(f"{name:16} {elapsed:>8.3f} {hits:>14,}")
    print("pass 1: hits from vLLM's own prefix cache (the shared system prompt, after the first request);")
    print("pass 2: vLLM's prefix cache was reset, so every hit was loaded from Mooncake through kvpipe.")
    print(
        f"speed-up of pass 2: {passes[0][1] / passes[1][1]:.2f}x; outputs identical: {passes[0][3] == passes[1][3]}"
    )


if __name__ == "__main__":
    main()
