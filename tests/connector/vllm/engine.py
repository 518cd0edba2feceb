"""The tiny model under vLLM as the tests run it: their prompts, and an engine in this process or another.

The engine set-up itself (model folder, connector configs, one timed pass) is
:mod:`kvpipe.connector.engines.launch`, shared with the demo and the bench; an engine
in another process is the bench's :class:`~kvpipe.connector.bench.vllm_engine.EngineProcess`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kvpipe.connector.bench.vllm_engine import EngineProcess
from kvpipe.connector.engines import launch

MODEL_DIR = launch.model_dir("tiny-llama", launch.TINY_LLAMA)
PROMPT_TOKENS = 600
MAX_TOKENS = 8
BLOCK = 128
#: full chunks of a 600-token prompt: the hit when everything is stored
FULL_HIT = PROMPT_TOKENS // BLOCK * BLOCK


#: layer by layer both ways, every load in its request's step (``load_async: false``: one KV-cache group)
LAYERWISE = {"load_layerwise": True, "save_layerwise": True, "load_async": False}

#: the prefix every prompt of a :func:`family` shares: four whole chunks (the rest of a prompt: no whole one)
SHARED = 4 * BLOCK


def prompts(seed: int, count: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def family(seed: int, count: int) -> list[list[int]]:
    """``count`` prompts that share their first :data:`SHARED` tokens and differ after them."""
    rng = random.Random(seed)
    shared = [rng.randrange(1024) for _ in range(SHARED)]
    return [shared + [rng.randrange(1024) for _ in range(PROMPT_TOKENS - SHARED)] for _ in range(count)]


def make_llm(transfer: Mapping[str, Any] | None, **engine_args: Any) -> Any:
    return launch.make_llm(MODEL_DIR, transfer, **engine_args)


@contextmanager
def running(transfer: Mapping[str, Any], **engine_args: Any) -> Iterator[Any]:
    """An engine on the tiny model with ``transfer`` and ``engine_args``, closed on the way out."""
    instance = make_llm(transfer, **engine_args)
    try:
        yield instance
    finally:
        launch.close_llm(instance)


def generate(llm: Any, batch: list[list[int]]) -> dict[str, Any]:
    """One pass, as a dict: the same shape an engine process answers with."""
    return launch.generate(llm, batch, MAX_TOKENS).as_dict()


def gen(seed: int) -> dict[str, Any]:
    """The engine-process command for one pass over ``prompts(seed)``."""
    return {"generate": prompts(seed), "max_tokens": MAX_TOKENS}


def scheduler(llm: Any) -> Any:
    """The scheduler side (:class:`~kvpipe.connector.vllm.scheduler.SchedulerSide`) of ``llm``."""
    return launch.sides(llm)[0]


def worker(llm: Any) -> Any:
    """The worker side (:class:`~kvpipe.connector.vllm.worker.WorkerSide`) of ``llm``."""
    side = launch.sides(llm)[1]
    assert side.started
    return side


def rerun(llm: Any, batch: list[list[int]]) -> tuple[dict[str, Any], Counter[str]]:
    """The batch again after vLLM's prefix cache is cleared: the pass, and the worker's counts it added."""
    before = Counter(worker(llm).stats)
    assert llm.reset_prefix_cache()
    result = generate(llm, batch)
    assert worker(llm).drain(10.0)
    return result, Counter(worker(llm).stats) - before


def run_engine_process(
    transfer: Mapping[str, Any], commands: Sequence[Mapping[str, Any]], env: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """A new engine process on the tiny model: each command's answer, in order."""
    with EngineProcess({"model": str(MODEL_DIR), "transfer": dict(transfer)}, env) as process:
        return [process.call(command) for command in commands]


def stored_by(llm: Any, batch: list[list[int]]) -> tuple[dict[str, Any], list[Any]]:
    """One pass over ``batch``, its saves drained: the pass and the records it put, first put first."""
    before = len(worker(llm).observed)
    result = generate(llm, batch)
    assert worker(llm).drain(10.0)
    records = [
        record for record, status in list(worker(llm).observed)[before:] if status.value == "put"
    ]
    return result, records


def read(holder: Any, key: str, size: int) -> Any:
    """The ``size`` bytes of the object ``key`` (a uint8 tensor)."""
    import torch

    value = torch.zeros(size, dtype=torch.uint8)
    assert holder.register_buffer(value.data_ptr(), size) == 0
    try:
        assert holder.batch_get_into([key], [value.data_ptr()], [size]) == [size]
    finally:
        holder.unregister_buffer(value.data_ptr())
    return value


def objects(holder: Any, keys: list[str]) -> dict[str, bytes]:
    """The bytes of each object under ``keys``, by key."""
    return {key: bytes(read(holder, key, holder.get_size(key)).tolist()) for key in keys}


def overwrite(holder: Any, keys: list[str], value: Any) -> None:
    """Replace each object under ``keys`` with the bytes of ``value`` (a uint8 tensor)."""
    size = value.numel()
    assert holder.register_buffer(value.data_ptr(), size) == 0
    try:
        for key in keys:
            assert holder.remove(key, force=True) == 0
        codes = holder.batch_put_from(
            keys, [value.data_ptr()] * len(keys), [size] * len(keys), holder.new_replicate_config()
        )
        assert codes == [0] * len(keys)
    finally:
        holder.unregister_buffer(value.data_ptr())
