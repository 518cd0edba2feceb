"""The KV data model and the stages of the save path (see the README, "The save pipeline").

Knows no vLLM and no Mooncake: the engine is described by :mod:`.model`, the store
by the :class:`SavingStore` and :class:`LoadingStore` protocols.
"""

from .backoff import Backoff
from .chunks import Chunk, chunk_hash_at, chunks_to_save, full_chunks, tail_chunks
from .collect import FullChunksStage, TailStage, chunk_records
from .default_pipeline import DEFAULT_SAVE_PIPELINE, default_save_graph
from .filter import FilterStage
from .flags import ConfigError, StrictFlag, parse_flag
from .gather import GatherParams, GatherStage
from .group_ids import GroupIdsParams, GroupIdsStage
from .integrity import Integrity, Seal, Verdict, fingerprint, is_seal_key, seal_key
from .keys import GROUP_ID_SCOPE, group_id, key_model_name, object_key, shared_pool_id
from .load import LoadObserver, LoadParams, LoadRequest, LoadStage, LoadTarget, load_targets
from .load_pipeline import (
    DEFAULT_LOAD_PIPELINE,
    default_load_graph,
)
from .lookup import (
    LookupRequest,
    longest_stored_prefix,
    lookup_keys,
    prefix_unit,
)
from .model import (
    BlockLayout,
    Buffer,
    GroupKind,
    GroupSpec,
    KeyNamespace,
    KVCache,
    ProjectedRequest,
    Records,
    Region,
    SaveRequest,
    Shard,
    StagedCopy,
    StoreGroup,
    StoreObject,
    spans,
)
from .object_status import ObjectObserver, ObjectReporter, ObjectStatus
from .project import ProjectStage
from .projection import ProjectionError, project_groups, storable_groups
from .put import MAX_BUFFERS_PER_CALL, PutParams, PutStage, split_into_calls
from .registry import KV_STAGES
from .seal import SealMemory
from .staging import StagingError, StagingPool, StagingSlot, copy_into_slots
from .store import EXISTS, Code, LoadingStore, SavingStore, describe
from .throttle import SlowStoreThrottle, ThrottleParams

__all__ = [
    "MAX_BUFFERS_PER_CALL",
    "EXISTS",
    "DEFAULT_LOAD_PIPELINE",
    "LoadObserver",
    "LoadParams",
    "LoadRequest",
    "LoadStage",
    "LoadTarget",
    "LookupRequest",
    "LoadingStore",
    "default_load_graph",
    "load_targets",
    "longest_stored_prefix",
    "lookup_keys",
    "prefix_unit",
    "DEFAULT_SAVE_PIPELINE",
    "default_save_graph",
    "GROUP_ID_SCOPE",
    "KV_STAGES",
    "Integrity",
    "Seal",
    "SealMemory",
    "Verdict",
    "fingerprint",
    "is_seal_key",
    "seal_key",
    "Backoff",
    "BlockLayout",
    "Buffer",
    "Chunk",
    "Code",
    "ConfigError",
    "FilterStage",
    "FullChunksStage",
    "GatherParams",
    "GatherStage",
    "GroupIdsParams",
    "GroupIdsStage",
    "GroupKind",
    "GroupSpec",
    "KVCache",
    "KeyNamespace",
    "ObjectObserver",
    "ObjectStatus",
    "SavingStore",
    "ObjectReporter",
    "ProjectStage",
    "ProjectedRequest",
    "ProjectionError",
    "PutParams",
    "PutStage",
    "Records",
    "Region",
    "StagedCopy",
    "SaveRequest",
    "Shard",
    "SlowStoreThrottle",
    "StagingError",
    "StagingPool",
    "StagingSlot",
    "StoreGroup",
    "StoreObject",
    "StrictFlag",
    "TailStage",
    "ThrottleParams",
    "chunk_records",
    "describe",
    "chunk_hash_at",
    "chunks_to_save",
    "full_chunks",
    "copy_into_slots",
    "group_id",
    "key_model_name",
    "shared_pool_id",
    "object_key",
    "parse_flag",
    "project_groups",
    "spans",
    "split_into_calls",
    "storable_groups",
    "tail_chunks",
]
