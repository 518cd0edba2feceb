"""The KV data model and the stages of the save path (see docs/architecture.md, "The save pipeline").

Knows no vLLM and no Mooncake: the engine is described by :mod:`.model`, the store
by the :class:`SavingStore` and :class:`LoadingStore` protocols.
"""

from .backoff import Backoff
from .batch_calls import MAX_BUFFERS_PER_CALL, split_into_calls
from .chunks import Chunk, chunk_hash_at, chunks_to_save, full_chunks, tail_chunks
from .errors import ConfigError
from .filter import FilterStage
from .flags import StrictFlag, parse_flag
from .full_and_tail import FullChunksStage, RecordMaker, TailStage
from .gather import GatherParams, GatherStage
from .group_ids import GroupIdsParams, GroupIdsStage
from .integrity import Integrity, Seal, SealEntry, Verdict, fingerprint, is_seal_key, seal_key
from .keys import GROUP_ID_SCOPE, group_id, key_model_name, object_key, shared_pool_id
from .load import LayerObserver, LoadObserver, LoadParams, LoadStage, LoadTarget, load_targets
from .load_pipeline import (
    DEFAULT_LOAD_PIPELINE,
    default_load_graph,
)
from .load_plan import LoadRequest
from .lookup import (
    LookupPlan,
    LookupRequest,
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
from .object_status import FailReason, ObjectObserver, ObjectReporter, ObjectStatus
from .project import ProjectStage
from .put import PutParams, PutStage
from .registry import KV_STAGES
from .save_pipeline import DEFAULT_SAVE_PIPELINE, default_save_graph
from .seal import SealMemory
from .staging import StagingError, StagingPool, StagingSlot, copy_into_slots, gather_into_slots
from .storable import ProjectionError, project_groups, storable_groups
from .store import EXISTS, Code, LoadingStore, SavingStore, describe
from .throttle import SlowStoreThrottle, ThrottleParams

__all__ = [
    "DEFAULT_LOAD_PIPELINE",
    "DEFAULT_SAVE_PIPELINE",
    "EXISTS",
    "GROUP_ID_SCOPE",
    "KV_STAGES",
    "MAX_BUFFERS_PER_CALL",
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
    "Integrity",
    "KVCache",
    "KeyNamespace",
    "LayerObserver",
    "LoadObserver",
    "LoadParams",
    "LoadRequest",
    "LoadStage",
    "LoadTarget",
    "LoadingStore",
    "LookupPlan",
    "LookupRequest",
    "ObjectObserver",
    "ObjectReporter",
    "ObjectStatus",
    "FailReason",
    "ProjectStage",
    "ProjectedRequest",
    "ProjectionError",
    "PutParams",
    "PutStage",
    "RecordMaker",
    "Records",
    "Region",
    "SaveRequest",
    "SavingStore",
    "Seal",
    "SealEntry",
    "SealMemory",
    "Shard",
    "SlowStoreThrottle",
    "StagedCopy",
    "StagingError",
    "StagingPool",
    "StagingSlot",
    "StoreGroup",
    "StoreObject",
    "StrictFlag",
    "TailStage",
    "ThrottleParams",
    "Verdict",
    "chunk_hash_at",
    "chunks_to_save",
    "copy_into_slots",
    "gather_into_slots",
    "default_load_graph",
    "default_save_graph",
    "describe",
    "fingerprint",
    "full_chunks",
    "group_id",
    "is_seal_key",
    "key_model_name",
    "load_targets",
    "object_key",
    "parse_flag",
    "prefix_unit",
    "project_groups",
    "seal_key",
    "shared_pool_id",
    "spans",
    "split_into_calls",
    "storable_groups",
    "tail_chunks",
]
