"""Skewed reuse traces and the offline answers to "what should the store have kept?".

A serving fleet's prompts are a few shared prefixes (system prompts, documents)
asked for over and over, with a long tail asked once. :func:`zipf_trace` makes
such a trace: each request is a *prefix* drawn from Zipf(s) over ``prefixes``
shared ones (or, with ``one_off_share``, a document of its own that nobody asks
for again) followed by a suffix of its own. Every prefix and document is the same
number of chunks, so the store's capacity can be counted in prefixes.

Two offline policies read the whole trace and bound what any store could do:

- :func:`best_static_hits`: keep the most popular prefixes that fit, forever;
- :func:`belady_hits`: Belady's MIN over whole prefixes (evict the one asked for
  again furthest in the future, or do not store the new one if it is that one),
  optimal for items of one size.

Both count a prefix's first request as a miss (nobody can hit what was never
computed), and both hit whole prefixes only: suffixes are never asked again, so an
optimal store never keeps them. Hit rates are chunk counts: hit chunks over the
chunks of every prompt, as a serving engine counts hit tokens.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: prefix ``prefix`` (``shared``, or a one-off document) and its own suffix."""

    index: int
    prefix: str
    shared: bool


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in arrival order; every prefix is ``prefix_chunks`` chunks, every suffix ``suffix_chunks``."""

    requests: tuple[TraceRequest, ...]
    prefixes: int
    prefix_chunks: int
    suffix_chunks: int

    @property
    def prompt_chunks(self) -> int:
        return len(self.requests) * (self.prefix_chunks + self.suffix_chunks)

    def hit_rate(self, hit_chunks: int) -> float:
        return hit_chunks / self.prompt_chunks if self.requests else 0.0


def zipf_trace(
    *,
    requests: int,
    prefixes: int,
    s: float,
    prefix_chunks: int,
    suffix_chunks: int,
    one_off_share: float = 0.0,
    seed: int = 0,
) -> Trace:
    """``requests`` requests whose prefix rank ``k`` (1-based) is drawn with weight ``1 / k**s``.

    :raises ValueError: a count is not positive, or ``one_off_share`` is outside [0, 1).
    """
    for name, value in (("requests", requests), ("prefixes", prefixes), ("prefix_chunks", prefix_chunks)):
        if value <= 0:
            raise ValueError(f"zipf_trace: {name} must be > 0, got {value}")
    if not 0.0 <= one_off_share < 1.0:
        raise ValueError(f"zipf_trace: one_off_share must be in [0, 1), got {one_off_share}")
    rng = random.Random(seed)
    weights = [1.0 / rank**s for rank in range(1, prefixes + 1)]
    drawn: list[TraceRequest] = []
    for index in range(requests):
        if rng.random() < one_off_share:
            drawn.append(TraceRequest(index, f"doc-{index}", shared=False))
        else:
            rank = rng.choices(range(prefixes), weights)[0]
            drawn.append(TraceRequest(index, f"prefix-{rank}", shared=True))
    return Trace(tuple(drawn), prefixes, prefix_chunks, suffix_chunks)


def best_static_hits(trace: Trace, capacity_prefixes: int) -> int:
    """Hit chunks of a store that keeps the ``capacity_prefixes`` most asked prefixes and nothing else."""
    counts = Counter(request.prefix for request in trace.requests)
    kept = [prefix for prefix, _ in counts.most_common(max(capacity_prefixes, 0))]
    # every request after its prefix's first is a hit
    return sum(counts[prefix] - 1 for prefix in kept) * trace.prefix_chunks


def belady_hits(trace: Trace, capacity_prefixes: int) -> int:
    """Hit chunks of Belady's MIN over whole prefixes, with the choice not to store at all."""
    if capacity_prefixes <= 0:
        return 0
    order = [request.prefix for request in trace.requests]
    following = _next_uses(order)
    kept: dict[str, int] = {}  # prefix -> the index of its next request (len(order) when none)
    hits = 0
    for index, prefix in enumerate(order):
        next_use = following[index]
        if prefix in kept:
            hits += 1
            kept[prefix] = next_use
            continue
        if len(kept) < capacity_prefixes:
            kept[prefix] = next_use
            continue
        furthest = max(kept, key=kept.__getitem__)
        if kept[furthest] > next_use:
            del kept[furthest]
            kept[prefix] = next_use
    return hits * trace.prefix_chunks


def _next_uses(order: Sequence[str]) -> list[int]:
    """For each position, the position of the same prefix's next request (``len(order)`` if none)."""
    following = [len(order)] * len(order)
    last_seen: dict[str, int] = {}
    for index in range(len(order) - 1, -1, -1):
        following[index] = last_seen.get(order[index], len(order))
        last_seen[order[index]] = index
    return following
