"""``parse_object_key`` is the inverse of ``object_key``: it reads back every key it made, and nothing else."""

from hypothesis import given
from hypothesis import strategies as st

from kvpipe.stages import KeyNamespace, key_model_name, object_key
from kvpipe.stages.keys import ObjectKeyParts, parse_object_key

HASH = bytes.fromhex("00ff10ab")

#: model names as engines spell them: a path whose last component is the key's model part (and
#: never reads as a store format's namespace part)
models = st.text(min_size=1).filter(
    lambda name: (
        "@" not in key_model_name(name)
        and key_model_name(name)
        and not key_model_name(name).startswith(("store_tp:", "store_pp:", "store_format:"))
    )
)
ranks = st.integers(min_value=0, max_value=10_000)
#: the store formats' namespaces (vLLM's connector's): none, sharded, replicated MQA, compatibility
namespaces = st.sampled_from(
    [
        "",
        "@store_tp:4@store_pp:1@store_format:tp_shared_lbhnc",
        "@store_tp:8@store_pp:2@store_format:tp_shared_lbnhc",
        "@store_pp:1@store_format:tp_shared_mqa",
        "@store_pp:1@store_format:rank_local_tp2_layout_LHBNC",
    ]
)


@given(
    model=models,
    cache_prefix=st.text(),
    tp=ranks,
    pcp=ranks,
    dcp=ranks,
    pp=ranks,
    store_group=ranks,
    chunk_hash=st.binary(max_size=40),
    store_namespace=namespaces,
)
def test_parsing_a_key_gives_back_what_made_it(
    model, cache_prefix, tp, pcp, dcp, pp, store_group, chunk_hash, store_namespace
):
    namespace = KeyNamespace(
        model,
        cache_prefix,
        tp_rank=tp,
        pcp_rank=pcp,
        dcp_rank=dcp,
        pp_rank=pp,
        store_namespace=store_namespace,
    )
    key = object_key(namespace, store_group, chunk_hash)

    parts = parse_object_key(key)

    keyed = KeyNamespace(key_model_name(model), cache_prefix, tp, pcp, dcp, pp, store_namespace)
    assert parts == ObjectKeyParts(keyed, store_group, chunk_hash)
    assert object_key(*parts) == key


@given(st.text())
def test_a_string_parses_only_if_object_key_makes_it_again(text):
    parts = parse_object_key(text)

    assert parts is None or object_key(*parts) == text


def test_the_vllm_format_parses_into_its_parts():
    parts = parse_object_key("pfx@tiny-llama@tp_rank:1@pcp2@dcp3@pp_rank:4@group:5@00ff10ab")

    assert parts == ObjectKeyParts(KeyNamespace("tiny-llama", "pfx", 1, 2, 3, 4), 5, HASH)


def test_a_key_without_a_cache_prefix_has_an_empty_one():
    parts = parse_object_key("tiny-llama@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@00ff10ab")

    assert parts is not None and parts.namespace.cache_prefix == "" and parts.namespace.model == "tiny-llama"


def test_a_cache_prefix_may_hold_at_signs():
    key = object_key(KeyNamespace("m", cache_prefix="a@b"), 0, HASH)

    parts = parse_object_key(key)

    assert parts is not None and parts.namespace == KeyNamespace("m", "a@b")


def test_strings_object_key_cannot_make_are_none():
    for text in (
        "",
        "not-a-kvpipe-key",
        "m@tp_rank:01@pcp0@dcp0@pp_rank:0@group:0@00ff",  # leading zero
        "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@00FF",  # upper-case hex
        "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@0ff",  # odd hex
        "@m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@00ff",  # an empty prefix is omitted, never written
        "org/m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@00ff",  # the model part has no path
        "m@tp_rank:-1@pcp0@dcp0@pp_rank:0@group:0@00ff",
        "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@00ff@extra",
    ):
        assert parse_object_key(text) is None, text
