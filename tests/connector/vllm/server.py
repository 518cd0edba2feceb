"""A real ``vllm serve`` (vLLM's OpenAI-compatible HTTP server) on the tiny model, for tests.

:class:`VllmServer` is a fleet's replica (:func:`kvpipe.connector.fleet.replica.replica`:
``python -m vllm.entrypoints.openai.api_server`` in a process group of its own on a
free loopback port, its output in a log file, ready when ``/health`` answers, stopped
whole) with the tests' request helpers.

Prompts are token ids and the server runs without a tokenizer
(``--skip-tokenizer-init``): a completion asked with ``"return_token_ids": true``
carries its output ids in ``choices[0].token_ids``; ``--enable-prompt-tokens-details``
makes ``usage.prompt_tokens_details.cached_tokens`` report the request's prefix hit
(local and connector's together).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvpipe.connector.fleet.replica import replica

from . import engine


class ServerError(RuntimeError):
    """The server did not answer as it should; the message ends with its log's tail."""


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
        request_timeout_s: float = 120.0,
    ) -> None:
        self.model = str(model)
        self._served = replica(
            "vllm server",
            Path(self.model),
            log_path,
            transfer=transfer,
            env=env or {},
            max_model_len=512,
            kv_cache_memory_bytes=64 << 20,
            extra_args=["--skip-tokenizer-init", *extra_args],
        )
        self.url = self._served.url
        self._startup_timeout_s = startup_timeout_s
        self._request_timeout_s = request_timeout_s

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._served.process.pid

    @property
    def start_seconds(self) -> float | None:
        """From spawn to a healthy ``/health``."""
        return self._served.start_seconds

    def start(self) -> Self:
        self._served.start()
        try:
            self._served.wait_ready(self._startup_timeout_s)
        except BaseException:
            self._served.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after a deadline; none of its processes survives."""
        self._served.stop()

    def _tail_suffix(self) -> str:
        return self._served.process.tail_suffix()

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
