"""Keys and group ids are byte-compatible with vLLM's MooncakeStoreConnector."""

from kvpipe.stages import KeyNamespace, group_id, key_model_name, object_key

HASH = bytes.fromhex("00ff10ab")


def test_key_matches_vllm_format_byte_for_byte():
    key = object_key(KeyNamespace(model="tiny-llama"), store_group=0, chunk_hash=HASH)

    assert key == "tiny-llama@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@00ff10ab"


def test_key_starts_with_the_cache_prefix_when_there_is_one():
    key = object_key(KeyNamespace(model="tiny-llama", cache_prefix="pfx"), store_group=0, chunk_hash=HASH)

    assert key == "pfx@tiny-llama@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@00ff10ab"


def test_key_names_every_rank_and_the_store_group():
    namespace = KeyNamespace(model="m", tp_rank=1, pcp_rank=2, dcp_rank=3, pp_rank=4)

    assert (
        object_key(namespace, store_group=5, chunk_hash=HASH)
        == "m@tp_rank:1@pcp2@dcp3@pp_rank:4@group:5@00ff10ab"
    )


def test_key_uses_the_last_path_component_of_the_model_name():
    key = object_key(KeyNamespace(model="/models/org/tiny-llama/"), store_group=0, chunk_hash=HASH)

    assert key.startswith("tiny-llama@tp_rank:0@")


def test_key_model_name_is_the_last_path_component():
    assert key_model_name("meta-llama/Llama-3.1-8B") == "Llama-3.1-8B"
    assert key_model_name("/models/tiny-llama/") == "tiny-llama"
    assert key_model_name("tiny-llama") == "tiny-llama"


def test_group_id_has_no_rank_and_no_kv_cache_group():
    ranked = KeyNamespace(model="tiny-llama", tp_rank=3, pcp_rank=1, dcp_rank=2, pp_rank=1)

    gid = group_id(ranked, HASH)

    assert gid == "vllm-mooncake-store:tiny-llama@00ff10ab"
    assert gid == group_id(KeyNamespace(model="tiny-llama"), HASH)
    for dimension in ("tp_rank", "pcp", "dcp", "pp_rank", "group:"):
        assert dimension not in gid


def test_group_id_contains_the_cache_prefix_when_there_is_one():
    gid = group_id(KeyNamespace(model="tiny-llama", cache_prefix="pfx"), HASH)

    assert gid == "vllm-mooncake-store:pfx@tiny-llama@00ff10ab"


def test_group_id_has_no_prefix_part_when_the_cache_prefix_is_empty():
    gid = group_id(KeyNamespace(model="tiny-llama", cache_prefix=""), HASH)

    assert gid == "vllm-mooncake-store:tiny-llama@00ff10ab"
    assert "@@" not in gid and ":@" not in gid


def test_group_id_keeps_the_chunk_hash():
    chunk_hash = bytes(range(32))

    assert group_id(KeyNamespace(model="m"), chunk_hash).endswith("@" + chunk_hash.hex())
