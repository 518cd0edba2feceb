"""A generic staged-queue framework on anyio. It knows nothing of KV caches.

Stages (``stage``) are wired into a validated graph (``graph``, or from YAML via
``config`` and a ``registry`` of stage types), run with bounded queues and job
accounting (``runtime``, ``jobs``), and can be fed from ordinary threads through
the sync bridge (``bridge``).
"""

from .bridge import SyncPipeline, WhenFull
from .config import build_graph, graph_from_yaml
from .errors import BuildError, PipelineClosed, PipelineError
from .graph import BatchPolicy, Graph, StageSpec
from .jobs import Job, Outcome
from .metrics import StageSnapshot
from .registry import NoParams, Resources, StageRegistry
from .runtime import Pipeline
from .stage import DEFAULT_PORT, BatchEntry, BatchStage, Emit, Stage

__all__ = [
    "DEFAULT_PORT",
    "BatchEntry",
    "BatchPolicy",
    "BatchStage",
    "BuildError",
    "Emit",
    "Graph",
    "Job",
    "NoParams",
    "Outcome",
    "Pipeline",
    "PipelineClosed",
    "PipelineError",
    "Resources",
    "StageRegistry",
    "StageSnapshot",
    "StageSpec",
    "Stage",
    "SyncPipeline",
    "WhenFull",
    "build_graph",
    "graph_from_yaml",
]
