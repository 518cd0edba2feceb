"""Object keys and group ids, byte-compatible with vLLM's MooncakeStoreConnector.

Two connectors serving the same model from one store only share a cache if they
name every chunk identically, so the formats below copy vLLM's byte for byte:

- key: ``{cache_prefix@}{model}{ns}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:{g}@{hash}``
- group id: ``vllm-mooncake-store:{cache_prefix@}{model}{ns}@{hash}``

- a seal (:mod:`.integrity`, kvpipe's own): ``{object key}@kvpipe-seal``

``cache_prefix@`` is omitted when the prefix is empty; ``ns`` is the store format's
namespace (empty for rank-local objects; see :class:`~.model.KeyNamespace`); ``hash``
is the chunk hash in lowercase hex; ``g`` is the *store* group (the storable
projection's numbering).
:func:`parse_object_key` reads a key back (the inverse of :func:`object_key`), so
tools that list a store (``kvpipe inspect``) use this one format too.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

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
        f"{_model_scope(namespace)}{namespace.store_namespace}@tp_rank:{namespace.tp_rank}@pcp{namespace.pcp_rank}"
        f"@dcp{namespace.dcp_rank}@pp_rank:{namespace.pp_rank}@group:{store_group}@"
    )


#: a seal's key is its object's key with this appended: a seal sorts and scopes with its
#: object (the reset's pattern anchors the model scope at the start and takes seals along),
#: and vLLM's connector, which asks for object keys only, never sees one
SEAL_SUFFIX = "@kvpipe-seal"


#: a layer seal's (:mod:`.layer_seals`): beside the seal, under the same anchor
LAYER_SEAL_SUFFIX = "@kvpipe-layers"


def seal_key(key: str) -> str:
    """The key of the seal of the object ``key``."""
    return key + SEAL_SUFFIX


def layer_seal_key(key: str) -> str:
    """The key of the layer seal of the object ``key`` (the seal's anchor)."""
    return key + LAYER_SEAL_SUFFIX


def is_seal_key(key: str) -> bool:
    return key.endswith(SEAL_SUFFIX)


def is_layer_seal_key(key: str) -> bool:
    return key.endswith(LAYER_SEAL_SUFFIX)


def is_object_key(key: str) -> bool:
    """Whether ``key`` names a KV object rather than kvpipe's metadata about objects (a seal, a layer seal)."""
    return not (key.endswith(SEAL_SUFFIX) or key.endswith(LAYER_SEAL_SUFFIX))


def sealed_key(seal: str) -> str:
    """The object key a seal's or a layer seal's key belongs to (the inverse of :func:`seal_key`)."""
    for suffix in (SEAL_SUFFIX, LAYER_SEAL_SUFFIX):
        if seal.endswith(suffix):
            return seal[: -len(suffix)]
    return seal


def key_chunk_hex(key: str) -> str:
    """The chunk hash an object's or a seal's key names, in hex (no parsing of the rest: a hot path)."""
    return sealed_key(key).rsplit("@", 1)[1]


#: a store format's namespace as :func:`object_key` writes it (vLLM's connector's formats)
_STORE_NAMESPACE = r"(?:@store_tp:\d+)?(?:@store_pp:\d+@store_format:[0-9A-Za-z_]+)?"


def deployment_key_pattern(namespace: KeyNamespace) -> str:
    """A regex that finds the keys of ``namespace``'s model and cache prefix, every rank's and format's, and no others.

    Anchored, and the scope is followed by a store format's namespace (or none) and
    ``@tp_rank:``: a deployment whose cache prefix is another's model name
    (``tiny@other@tp_rank:...`` beside ``tiny@tp_rank:...``) is never taken along.
    Written for Mooncake's ``remove_by_regex`` (ECMAScript, searched) and Python's
    ``re`` alike.
    """
    return f"^{re.escape(_model_scope(namespace))}{_STORE_NAMESPACE}@tp_rank:"


def shared_pool_id(namespace: KeyNamespace) -> str:
    """The shared pool a deployment's chunks live in, as KV events name it (their ``ownership``).

    Every replica of a deployment reaches the same chunks in the store, so the pool
    is the deployment (its cache prefix and model), never one engine: a router that
    files a chunk under this pool files it as shared, not as the writer's own.
    """
    return f"{GROUP_ID_SCOPE}:{_model_scope(namespace)}"


def group_id(namespace: KeyNamespace, chunk_hash: bytes) -> str:
    """The lifecycle group of a chunk: every rank's object of every store group.

    Ranks and store groups are deliberately left out (a store format's namespace
    stays in, as in vLLM's connector: objects of two formats are two chunks). A chunk is only reusable when
    all of its objects are present, and Mooncake leases and evicts a group as one,
    so one group per chunk across all shards and groups means a chunk is either
    whole in the store or gone, never half evicted.
    """
    return f"{GROUP_ID_SCOPE}:{_model_scope(namespace)}{namespace.store_namespace}@{chunk_hash.hex()}"


class ObjectKeyParts(NamedTuple):
    """What an object key names: its namespace (model as keyed), store group and chunk hash."""

    namespace: KeyNamespace
    store_group: int
    chunk_hash: bytes


#: ``{cache_prefix@}{model}{ns}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:{g}@{hash}``; the
#: model is what follows the scope's last ``@`` (so a cache prefix may hold ``@``, a model not),
#: never a part of a store format's namespace
_KEY = re.compile(
    r"(?:(?P<prefix>.*)@)?(?P<model>(?!store_(?:tp|pp|format):)[^@]+)(?P<ns>" + _STORE_NAMESPACE + r")"
    r"@tp_rank:(?P<tp>\d+)@pcp(?P<pcp>\d+)@dcp(?P<dcp>\d+)"
    r"@pp_rank:(?P<pp>\d+)@group:(?P<group>\d+)@(?P<hash>(?:[0-9a-f]{2})*)",
    re.DOTALL,
)


def parse_object_key(key: str) -> ObjectKeyParts | None:
    """The parts of a key :func:`object_key` made, or None for any other string.

    The inverse of :func:`object_key`: for a key it returns parts from which
    :func:`object_key` makes the very same key, and a string it could not have
    made (another tool's key, leading zeros, upper-case hex, an empty model)
    is None. The namespace's model is the key's model part (:func:`key_model_name`
    of the engine's name). A model name with ``@`` in it cannot be told from a
    cache prefix in this format (vLLM's): the model is read as what follows the
    last ``@`` before the ranks.
    """
    match = _KEY.fullmatch(key)
    if match is None:
        return None
    namespace = KeyNamespace(
        model=match["model"],
        cache_prefix=match["prefix"] or "",
        tp_rank=int(match["tp"]),
        pcp_rank=int(match["pcp"]),
        dcp_rank=int(match["dcp"]),
        pp_rank=int(match["pp"]),
        store_namespace=match["ns"],
    )
    parts = ObjectKeyParts(namespace, int(match["group"]), bytes.fromhex(match["hash"]))
    if object_key(*parts) != key:  # e.g. "tp_rank:01", "@model@...", "a/b@..."
        return None
    return parts
