"""Running the tiny model under vLLM, shared by the tests and their subprocess scripts.

Run as a script (``python -m tests.vllm.engine SPEC_JSON``) it builds one engine from the
spec, runs its passes and prints one ``RESULT {json}`` line: what a test in another
process (or in vLLM's multiprocess mode, which needs a ``__main__`` guard) reports back.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

MODEL_DIR = Path(__file__).parent / "tiny-llama"
PROMPT_TOKENS = 600
MAX_TOKENS = 8
BLOCK = 128
#: full chunks of a 600-token prompt: the hit when everything is stored
FULL_HIT = PROMPT_TOKENS // BLOCK * BLOCK


def prompts(seed: int, count: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def kvpipe_transfer(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KVPipeConnector",
        "kv_connector_module_path": "kvpipe.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def mooncake_transfer(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra or {},
    }


def make_llm(transfer: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
        model=str(MODEL_DIR),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=1024,
        dtype="bfloat16",
        kv_cache_memory_bytes=64 << 20,
        kv_transfer_config=KVTransferConfig(**transfer) if transfer else None,
        disable_log_stats=False,
    )


def generate(llm: Any, batch: list[list[int]]) -> dict[str, Any]:
    """One pass: per prompt its output tokens and cached tokens, and the wall time."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "cached": [o.num_cached_tokens for o in outputs],
        "seconds": round(time.perf_counter() - start, 3),
    }


def close_llm(llm: Any) -> None:
    """Shut an engine down now (its connector closes its store client), not at some later GC."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001, S110 - best effort; the object is dropped anyway
        pass
    del llm
    gc.collect()


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the engine of ``spec`` and run ``spec["steps"]``: ["gen:SEED", "reset", "sleep:S", ...]."""
    llm = make_llm(spec.get("transfer"))
    results: list[Any] = []
    try:
        for step in spec["steps"]:
            if step.startswith("sleep:"):
                time.sleep(float(step.split(":")[1]))
                results.append({"slept": float(step.split(":")[1])})
            elif step == "reset":
                results.append({"reset": bool(llm.reset_prefix_cache())})
            else:
                results.append(generate(llm, prompts(int(step.split(":")[1]))))
    finally:
        close_llm(llm)
    return {"steps": results, "pid": os.getpid()}


if __name__ == "__main__":
    result = run_spec(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    # vLLM's MooncakeStoreConnector leaves its ZMQ lookup thread running after shutdown,
    # which hangs interpreter exit; the result is out, so leave without waiting for it.
    os._exit(0)
