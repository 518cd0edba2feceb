"""What the fleet tests send: streamed text completions of word prompts, a steady traffic of them, replica counters."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpipe.connector.bench.serve import replica_counters
from kvpipe.connector.fleet.tokenizer import random_text

#: vLLM's counters: prompt tokens a connector served; requests a replica finished
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
REQUESTS_DONE = "vllm:request_success_total"
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    seconds: float


def words(seed: int, count: int, vocab_size: int = 1024) -> str:
    """A prompt of ``count`` tokens: random words of the fleet's tokenizer."""
    return random_text(random.Random(seed), count, vocab_size)


def complete(
    url: str, model: str, prompt: str, max_tokens: int = 4, extra: dict[str, Any] | None = None
) -> Answer:
    """One greedy, streamed completion of ``prompt`` through ``url`` (the router or a replica).

    ``extra``: more fields of the request's body (``kv_transfer_params``).
    :raises OSError: the request failed (an HTTP error status included).
    """
    body = {
        **(extra or {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.monotonic()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:  # noqa: S310 - loopback
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices") or ():
                if choice.get("text") and first is None:
                    first = time.monotonic()
                text.append(choice.get("text") or "")
            usage = chunk.get("usage") or usage
    done = time.monotonic()
    return Answer(
        "".join(text),
        int(usage.get("prompt_tokens", 0)),
        int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        (first or done) - started,
        done - started,
    )


def counter(url: str, name: str) -> float:
    """The sum of a replica's ``name`` samples (its ``/metrics``)."""
    return replica_counters([url], [name])[name]


@dataclass(frozen=True)
class Sent:
    """One request of a :class:`Traffic`: which pair, first or second, when, and what came back."""

    pair: int
    second: bool
    started: float  # monotonic
    answer: Answer | None
    error: str | None


@dataclass
class Traffic:
    """A thread sending pairs of equal prompts through the router, one request at a time.

    Under round robin the two requests of a pair land on different replicas: the
    first computes the prompt, the second can only hit it through the store, and
    the two outputs must be equal whatever the store did. ``pause_s`` between
    requests lets the first one's save land.
    """

    url: str
    model: str
    prompt_tokens: int = 384
    pause_s: float = 0.2
    seed: int = 0
    sent: list[Sent] = field(default_factory=list)
    _between: list[Callable[[], None]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        self._thread.start()
        return self

    def between_requests(self, action: Callable[[], None], timeout_s: float = REQUEST_TIMEOUT_S) -> float:
        """Run ``action`` on the traffic's thread after its current request; when it ran (monotonic).

        A fault that kills a replica strikes between requests: a request in flight on a
        killed process is lost whatever routes it; what is measured is where the next go.
        """
        done = threading.Event()
        when: list[float] = []

        def wrapped() -> None:
            when.append(time.monotonic())
            try:
                action()
            finally:
                done.set()

        self._between.append(wrapped)
        assert done.wait(timeout_s), "the traffic never reached a pause between requests"
        return when[0]

    def stop(self) -> list[Sent]:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(REQUEST_TIMEOUT_S * 2 + 10)
        assert not self._thread.is_alive()
        return self.sent

    def _run(self) -> None:
        pair = 0
        while not self._stop.is_set():
            prompt = words(self.seed * 1_000_000 + pair, self.prompt_tokens)
            for second in (False, True):
                started = time.monotonic()
                try:
                    self.sent.append(
                        Sent(pair, second, started, complete(self.url, self.model, prompt), None)
                    )
                except (OSError, urllib.error.URLError, ValueError) as error:
                    self.sent.append(Sent(pair, second, started, None, repr(error)))
                while self._between:
                    self._between.pop(0)()
                time.sleep(self.pause_s)
            pair += 1

    # -- what a test reads ---------------------------------------------------------------

    def failed(self) -> list[Sent]:
        return [s for s in self.sent if s.error is not None]

    def unequal_pairs(self) -> list[int]:
        """Pairs whose two answers differ (both answered)."""
        texts: dict[int, list[str]] = {}
        for s in self.sent:
            if s.answer is not None:
                texts.setdefault(s.pair, []).append(s.answer.text)
        return [pair for pair, both in texts.items() if len(both) == 2 and both[0] != both[1]]

    def hits(self, since: float, until: float = float("inf")) -> list[Sent]:
        """Second requests sent in ``[since, until)`` that hit (their prompt came from a cache)."""
        return [
            s
            for s in self.sent
            if s.second and since <= s.started < until and s.answer is not None and s.answer.cached_tokens > 0
        ]

    def ttft_p99(self, since: float, until: float = float("inf")) -> float:
        ttfts = sorted(s.answer.ttft_s for s in self.sent if s.answer and since <= s.started < until)
        return ttfts[int(0.99 * (len(ttfts) - 1))] if ttfts else float("nan")
