"""One vLLM engine in a process of its own, driven one JSON command per line.

Why a process: vLLM's own MooncakeStoreConnector leaves a ZMQ thread running after
shutdown that hangs interpreter exit, engines of different connectors should not
share a Python process (nor vLLM's global state), and a process per engine lets a
benchmark keep several engines up and take turns between them.

``python -m kvpipe.connector.bench.vllm_engine SPEC_JSON`` builds the engine of
``SPEC_JSON`` (``model``, ``transfer``, optional ``max_model_len``,
``kv_cache_memory_bytes`` and ``engine_args``: more ``LLM`` keyword arguments), prints ``RESULT {"ready": ...}``, then answers each
command read from stdin with one ``RESULT {json}`` line:

- ``{"generate": [[ids...], ...], "max_tokens": N}`` -> :class:`~kvpipe.connector.engines.launch.PassResult`
- ``{"reset": true}`` -> ``{"reset": bool}`` (vLLM's prefix cache; the connector's store stays)
- ``{"sleep": S}`` -> ``{"slept": S}``
- ``{"hook_times": true}`` -> :meth:`.HookReport.as_dict`: what the connector's hooks cost
  this thread (the engine's) since the last ask (engines of :mod:`.vllm_timed`'s connector)

and leaves at end of input. :class:`EngineProcess` is the other end.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import IO, Any, Self

PREFIX = "RESULT "
RESET_ATTEMPTS = 50


class EngineProcessError(RuntimeError):
    """The engine process died, answered nothing in time, or reported an error."""


class EngineProcess:
    """An engine process and its command channel. Use as a context manager.

    The process starts loading at once; :meth:`wait_ready` waits for it, so several
    engines can load side by side.
    """

    def __init__(self, spec: Mapping[str, Any], env: Mapping[str, str] | None = None) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps(dict(spec))],
            env={**os.environ, **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._results: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(self._process.stdout,), daemon=True)
        self._reader.start()
        self.ready: dict[str, Any] | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # unwinding an error or a signal: nothing more is wanted of the engine, and a
        # loading one reads no input (it would notice the end of it only when loaded)
        self.close(timeout_s=0.0 if exc_type is not None else 30.0)

    def _read(self, stdout: IO[str]) -> None:
        """Keep RESULT lines; vLLM's own log lines on stdout are dropped."""
        for line in stdout:
            if line.startswith(PREFIX):
                self._results.put(line[len(PREFIX) :])
        self._results.put(None)

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._results.get(timeout=timeout_s)
        except queue.Empty:
            raise EngineProcessError(
                f"engine process gave no answer in {timeout_s:g} s: {self.log_tail()}"
            ) from None
        if line is None:
            self._process.wait()
            raise EngineProcessError(
                f"engine process exited with {self._process.returncode}: {self.log_tail()}"
            )
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise EngineProcessError(f"engine process: {answer['error']}")
        return answer

    def cpu_seconds(self) -> float:
        """CPU time the engine process has used so far (user + system, all its threads)."""
        import psutil

        try:
            times = psutil.Process(self._process.pid).cpu_times()
        except psutil.Error:
            return 0.0
        return float(times.user + times.system)

    def wait_ready(self, timeout_s: float = 240.0) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self._next(timeout_s)
        return self.ready

    def call(self, command: Mapping[str, Any], timeout_s: float = 240.0) -> dict[str, Any]:
        """Send one command, return its answer."""
        self.wait_ready(timeout_s)
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(dict(command)) + "\n")
        self._process.stdin.flush()
        return self._next(timeout_s)

    def log_tail(self, chars: int = 4000) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-chars:]

    def close(self, timeout_s: float = 30.0) -> None:
        """End of input: the engine shuts down and the process leaves (killed past ``timeout_s``)."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            try:
                self._process.stdin.close()
            except OSError:
                pass
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._stderr.close()


def _answer_line(answer: dict[str, Any]) -> None:
    """One answer, written whole in one call: a log line another thread prints (vLLM's and
    the connector's loggers write to stdout too) may come between two writes, never inside one."""
    sys.stdout.write(f"{PREFIX}{json.dumps(answer)}\n")
    sys.stdout.flush()


def _answer(llm: Any, command: Mapping[str, Any]) -> dict[str, Any]:
    from kvpipe.connector.engines.launch import generate

    if "generate" in command:
        return generate(llm, command["generate"], int(command.get("max_tokens", 8))).as_dict()
    if "reset" in command:
        return {"reset": _reset_prefix_cache(llm)}
    if "sleep" in command:
        time.sleep(float(command["sleep"]))
        return {"slept": float(command["sleep"])}
    if "hook_times" in command:
        return _hook_times(llm)
    return {"error": f"unknown command {sorted(command)}"}


def _hook_times(llm: Any) -> dict[str, Any]:
    """The timed connector's hook times since the last ask, read on the engine's thread (this one).

    :raises TypeError: the engine's connector is not the bench's timed one.
    """
    from kvpipe.connector.engines.launch import connectors

    from .vllm_timed import CLOCK, TimedKVPipeConnector

    scheduler, _ = connectors(llm)
    if not isinstance(scheduler, TimedKVPipeConnector):
        raise TypeError(f"the engine's connector is {type(scheduler).__name__}, not the timed one")
    return CLOCK.take().as_dict()


def _reset_prefix_cache(llm: Any) -> bool:
    """Clear vLLM's own prefix cache, stepping the engine until no block is held.

    vLLM's MooncakeStoreConnector pins the blocks it saves until the worker reports
    the save done, which the scheduler only learns at its next step; in-process,
    nothing steps the engine after ``generate`` returns, so the reset fails ("some
    blocks are not freed yet"). A request shorter than a block stores and caches
    nothing and gives the engine that step.
    """
    from kvpipe.connector.engines.launch import generate

    for _ in range(RESET_ATTEMPTS):
        if llm.reset_prefix_cache():
            return True
        generate(llm, [[0] * 4], max_tokens=1)
        time.sleep(0.05)
    return False


def _serve(spec: Mapping[str, Any]) -> None:
    from kvpipe.connector.engines.launch import close_llm, make_llm

    started = time.perf_counter()
    llm = make_llm(
        spec["model"],
        spec.get("transfer"),
        max_model_len=int(spec.get("max_model_len", 1024)),
        kv_cache_memory_bytes=int(spec.get("kv_cache_memory_bytes", 64 << 20)),
        **dict(spec.get("engine_args", {})),
    )
    _answer_line({"ready": round(time.perf_counter() - started, 2), "pid": os.getpid()})
    try:
        for line in sys.stdin:
            if line.strip():
                try:
                    answer = _answer(llm, json.loads(line))
                except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                _answer_line(answer)
    finally:
        close_llm(llm)


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's MooncakeStoreConnector leaves its ZMQ lookup thread running after shutdown,
    # which hangs interpreter exit; everything is answered, so leave without waiting for it.
    os._exit(0)
