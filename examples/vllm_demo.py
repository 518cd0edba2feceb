"""kvpipe as vLLM's KV connector: the tiny model twice, the second pass served from Mooncake.

    make vllm-demo          (or: .venv/bin/python examples/vllm_demo.py)

Spawns a local mooncake_master on free loopback ports and a client that holds the
store's memory (as a dedicated store process would), then runs the same prompts
twice through vLLM with KVPipeConnector, clearing vLLM's own prefix cache in
between, so every prefix hit of the second pass comes from the store. Prints the
hits and both passes' wall times, framed, last. CPU only, dummy weights, no download.

The engine's own logs are turned down to errors, so the result stands out; set the
variables yourself to see them all (the demo only sets those left unset):

    VLLM_LOGGING_LEVEL=INFO MC_LOG_LEVEL=INFO TORCH_CPP_LOG_LEVEL=WARNING make vllm-demo

Each Mooncake client logs ``E... transfer_metadata.cpp:1098] Local segment descriptor
not found`` as it starts (two here: the segment holder and the engine's client).
Harmless: the client's TCP transport asks for its own segment's descriptor before it
has written one (Mooncake's ``TcpTransport::allocateLocalSegmentID``), and with
peer-to-peer metadata (``P2PHANDSHAKE``, a spawned master's) that miss is logged as an
error; it then writes the descriptor and goes on. Whether the client lends memory
(``global_segment_size``) does not matter. Mooncake's quietest level (``MC_LOG_LEVEL``)
is ERROR, so the line cannot go without every other error going too: the demo says
so instead, under its result.
"""

from __future__ import annotations

import os
import random
import warnings

#: what the demo says of Mooncake's one error line (the module docstring says why)
HARMLESS = (
    "Mooncake's 'E... transfer_metadata.cpp] Local segment descriptor not found' above (one per store\n"
    "client) is harmless: a starting client looks up its own descriptor before writing it."
)


def quiet_logs() -> None:
    """Turn the engine's logs down to errors, unless the caller's environment says otherwise."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM: its INFO and WARNING lines
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake: errors only (it sets glog's level from it)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's C++ warnings (NUMA binding)
    # vLLM touches a torch attribute torch deprecates; the warning is for vLLM's developers
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: starts in seconds
    quiet_logs()

    from kvpipe.connector.engines import launch
    from kvpipe.connector.store.mooncake.master import LocalMaster

    rng = random.Random(0)
    shared = [rng.randrange(1024) for _ in range(768)]  # a system prompt all requests share
    prompts = [shared + [rng.randrange(1024) for _ in range(200)] for _ in range(8)]
    model = launch.model_dir("tiny-llama", launch.TINY_LLAMA)

    with LocalMaster() as master:
        assert master.endpoints is not None
        # the engine is a pure client (no segment); the holder has the store's memory. A load
        # the store fails is recomputed (vLLM's default, "fail", fails the request instead)
        transfer = launch.kvpipe_transfer(
            {"store": launch.store_section(master.endpoints)}, load_failure_policy="recompute"
        )
        with launch.segment_holder(master.endpoints, "512MB"):
            llm = launch.make_llm(model, transfer, max_model_len=2048)
            try:
                passes = []
                for name in ("pass 1 (stores)", "pass 2 (loads)"):
                    passes.append((name, launch.generate(llm, prompts, max_tokens=16)))
                    llm.reset_prefix_cache()
                waited = launch.sides(llm)[0].stats["lookups_waited_for_saves"]
            finally:
                launch.close_llm(llm)

    prompt_tokens = sum(len(p) for p in prompts)
    rule = "=" * 100
    print(f"\n{rule}\nkvpipe vLLM demo: the tiny model twice, the second pass from Mooncake through kvpipe\n")
    print(f"{'':16} {'wall s':>8} {'cached tokens':>14} {'from kvpipe':>12} (of {prompt_tokens:,} prompt tokens)")
    for name, result in passes:
        print(f"{name:16} {result.seconds:>8.3f} {sum(result.cached):>14,} {result.connector_hits:>12,}")
    print("pass 1: hits from vLLM's own prefix cache (the shared system prompt, after the first request);")
    print("pass 2: vLLM's prefix cache was reset: kvpipe loads each stored prefix once, beside the")
    print("        engine's steps; requests sharing it wait for that load, then find the blocks in")
    print("        vLLM's prefix cache. It starts as pass 1 ends: a request whose prefix pass 1 was")
    print(f"        still saving waits for that save rather than computing it again ({waited} lookups waited).")
    (_, first), (_, second) = passes
    print(
        f"speed-up of pass 2: {first.seconds / second.seconds:.2f}x; "
        f"outputs identical: {first.tokens == second.tokens}"
    )
    print(f"\n{HARMLESS}\n{rule}")


if __name__ == "__main__":
    main()
