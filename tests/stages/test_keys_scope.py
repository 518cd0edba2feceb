"""The deployment key pattern: every key of one model and cache prefix, and no other's."""

from __future__ import annotations

import re

import pytest

from kvpipe.stages import KeyNamespace
from kvpipe.stages.keys import deployment_key_pattern, object_key

HASH = bytes(range(32))


def key(model: str, prefix: str, tp_rank: int = 0, group: int = 0) -> str:
    return object_key(KeyNamespace(model, prefix, tp_rank=tp_rank), group, HASH)


@pytest.mark.parametrize("prefix", ["", "team-a"])
def test_the_pattern_finds_every_rank_and_group_of_its_deployment(prefix: str) -> None:
    pattern = re.compile(deployment_key_pattern(KeyNamespace("org/tiny-1.5", prefix)))
    assert all(pattern.search(key("tiny-1.5", prefix, rank, group)) for rank in (0, 3) for group in (0, 1))


@pytest.mark.parametrize(
    ("model", "prefix"),
    [
        ("tiny-1.5", "team-b"),  # another cache prefix
        ("tiny-105", ""),  # '.' is no wildcard
        ("x", "tiny-1.5"),  # a prefix named like the model: tiny-1.5@x@tp_rank:...
        ("tiny-1.5-chat", ""),  # a longer model name
    ],
)
def test_the_pattern_finds_no_other_deployment_s_keys(model: str, prefix: str) -> None:
    pattern = re.compile(deployment_key_pattern(KeyNamespace("tiny-1.5", "")))
    assert not pattern.search(key(model, prefix))


@pytest.mark.parametrize(
    "store_namespace",
    [
        "@store_tp:4@store_pp:1@store_format:tp_shared_lbhnc",
        "@store_pp:1@store_format:tp_shared_mqa",
        "@store_pp:2@store_format:rank_local_tp2_layout_LBNHC",
    ],
)
def test_the_pattern_finds_its_deployments_keys_in_every_store_format(store_namespace: str) -> None:
    pattern = re.compile(deployment_key_pattern(KeyNamespace("tiny-1.5", "team-a")))
    sharded = object_key(
        KeyNamespace("tiny-1.5", "team-a", tp_rank=3, store_namespace=store_namespace), 0, HASH
    )
    assert pattern.search(sharded)
    other = object_key(KeyNamespace("tiny-1.5-chat", "team-a", store_namespace=store_namespace), 0, HASH)
    assert not pattern.search(other)
