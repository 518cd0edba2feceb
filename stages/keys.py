"""Object keys and group ids, byte-compatible with vLLM's MooncakeStoreConnector.

Two connectors serving the same model from one store only share a cache if they
name every chunk identically, so the formats below copy vLLM's byte for byte:

- key: ``{cache_prefix@}{model}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:{g}@{hash}``
- group id: ``vllm-mooncake-store:{cache_prefix@}{model}@{hash}``

``cache_prefix@`` is omitted when the prefix is empty; ``hash`` is the chunk hash in
lowercase hex; ``g`` is the *store* group (the storable projection's numbering).
"""

from __future__ import annotations

import functools

from .model import KeyNamespace

GROUP_ID_SCOPE = "vllm-mooncake-store"


def key_model_name(model: str) -> str:
    """The model part of keys: the last path component of the engine's model name.

    vLLM keys by ``model.rstrip("/").split("/")[-1]``, so ``/models/tiny-llama/``
    and ``org/tiny-llama`` both become ``tiny-llama``; doing the same keeps our
    keys equal to theirs whichever spelling the engine was given.
    """
    return model.rstrip("/").split("/")[-1]


def _model_scope(namespace: KeyNamespace) -> str:
    """``{cache_prefix@}{model}``: the part keys and group ids share."""
    model = key_model_name(namespace.model)
    return f"{namespace.cache_prefix}@{model}" if namespace.cache_prefix else model


def object_key(namespace: KeyNamespace, store_group: int, chunk_hash: bytes) -> str:
    """The key of one rank's object of one store group for one chunk."""
    return object_key_prefix(namespace, store_group) + chunk_hash.hex()


@functools.lru_cache(maxsize=1024)
def object_key_prefix(namespace: KeyNamespace, store_group: int) -> str:
    """Everything of a key but the chunk hash; the same for every chunk of a rank's group.

    Cached: a save formats one key per object, and all but the hash repeats.
    """
    return (
        f"{_model_scope(namespace)}@tp_rank:{namespace.tp_rank}@pcp{namespace.pcp_rank}"
        f"@dcp{namespace.dcp_rank}@pp_rank:{namespace.pp_rank}@group:{store_group}@"
    )


def group_id(namespace: KeyNamespace, chunk_hash: bytes) -> str:
    """The lifecycle group of a chunk: every rank's object of every store group.

    Ranks and store groups are deliberately left out. A chunk is only reusable when
    all of its objects are present, and Mooncake leases and evicts a group as one,
    so one group per chunk across all shards and groups means a chunk is either
    whole in the store or gone, never half evicted.
    """
    return f"{GROUP_ID_SCOPE}:{_model_scope(namespace)}@{chunk_hash.hex()}"
