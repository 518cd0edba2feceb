"""What the fleet tests send through the router: text completions of word prompts, and replica metrics."""

from __future__ import annotations

import json
import random
import urllib.request
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvpipe.connector.fleet.tokenizer import SPECIAL, word

#: vLLM's counter of prompt tokens a connector served
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int
    cached_tokens: int


def words(seed: int, count: int, vocab_size: int = 1024) -> str:
    """A prompt of ``count`` tokens: random words of the fleet's tokenizer."""
    rng = random.Random(seed)
    return " ".join(word(rng.randrange(len(SPECIAL), vocab_size)) for _ in range(count))


def complete(url: str, model: str, prompt: str, max_tokens: int = 8) -> Answer:
    """One greedy completion of ``prompt`` through ``url`` (the router or a replica)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310 - loopback
        answer: dict[str, Any] = json.loads(response.read())
    usage = answer["usage"]
    return Answer(
        answer["choices"][0]["text"],
        int(usage["prompt_tokens"]),
        int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
    )


def counter(url: str, name: str) -> float:
    """The sum of a replica's ``name`` samples (its ``/metrics``)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )
