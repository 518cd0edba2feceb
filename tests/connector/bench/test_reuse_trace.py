"""Reuse traces and the offline bounds the capacity bench sets kvpipe against."""

import pytest

from kvpipe.connector.bench.reuse_trace import Trace, TraceRequest, belady_hits, best_static_hits, zipf_trace


def _trace(*prefixes: str, prefix_chunks: int = 2) -> Trace:
    requests = tuple(TraceRequest(i, p, shared=not p.startswith("doc")) for i, p in enumerate(prefixes))
    return Trace(requests, len(set(prefixes)), prefix_chunks, suffix_chunks=1)


def test_a_trace_is_the_same_for_the_same_seed():
    make = dict(requests=50, prefixes=5, s=1.0, prefix_chunks=2, suffix_chunks=1, one_off_share=0.5)

    assert zipf_trace(**make, seed=3) == zipf_trace(**make, seed=3)


def test_a_different_seed_gives_a_different_trace():
    make = dict(requests=50, prefixes=5, s=1.0, prefix_chunks=2, suffix_chunks=1, one_off_share=0.5)

    assert zipf_trace(**make, seed=3) != zipf_trace(**make, seed=4)


def test_a_one_off_document_is_asked_for_once():
    trace = zipf_trace(requests=200, prefixes=5, s=1.0, prefix_chunks=2, suffix_chunks=1, one_off_share=0.5)
    documents = [r.prefix for r in trace.requests if not r.shared]

    assert documents and len(documents) == len(set(documents))


def test_a_steeper_zipf_asks_for_the_most_popular_prefix_more():
    def top_share(s: float) -> float:
        trace = zipf_trace(requests=2000, prefixes=20, s=s, prefix_chunks=1, suffix_chunks=1)
        return sum(r.prefix == "prefix-0" for r in trace.requests) / 2000

    assert top_share(1.2) > top_share(0.8)


@pytest.mark.parametrize(("field", "value"), [("requests", 0), ("prefixes", 0), ("prefix_chunks", 0)])
def test_a_count_below_one_is_refused_naming_it(field, value):
    make = dict(requests=1, prefixes=1, s=1.0, prefix_chunks=1, suffix_chunks=1)

    with pytest.raises(ValueError, match=f"{field} must be > 0, got {value}"):
        zipf_trace(**{**make, field: value})


def test_the_best_static_choice_keeps_the_most_asked_prefixes_and_misses_each_first_request():
    trace = _trace("a", "b", "a", "c", "a", "b")

    assert best_static_hits(trace, 1) == 2 * 2  # a's second and third requests, 2 chunks each
    assert best_static_hits(trace, 2) == 3 * 2  # and b's second


def test_belady_keeps_what_is_asked_again_soonest():
    trace = _trace("a", "b", "a", "b", "c", "c", "a")

    assert belady_hits(trace, 1) == 2 * 2  # a store of one: a (idx 2), then c (idx 5) or b (idx 3)


def test_belady_is_never_below_the_best_static_choice():
    trace = zipf_trace(requests=300, prefixes=12, s=1.0, prefix_chunks=1, suffix_chunks=1, one_off_share=0.5)

    for capacity in (1, 3, 6, 12):
        assert belady_hits(trace, capacity) >= best_static_hits(trace, capacity)


def test_hit_rates_count_every_chunk_of_every_prompt():
    trace = _trace("a", "a")  # 2 requests of 2 + 1 chunks

    assert trace.hit_rate(2) == 2 / 6
