"""The connector's metrics, one catalogue: each stats key, who reports it, its kind, unit and meaning.

A metric used to be a string in four places (the scheduler's and the worker's
``stats`` keys, :mod:`.prom`'s table, the docs' table), and they drifted. Now
the sides count under the names defined here, :mod:`.prom` registers one series
per :data:`CATALOGUE` entry, and docs/vllm-connector.md's table is :func:`markdown_table` of
it (tests hold all three to the catalogue).

The names are plain ``str`` constants, not enum members: the worker counts every
object it stores, and a str key costs that hot path a dict update and nothing
more; keys also cross vLLM's process boundaries, where a plain str is what every
serializer takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, Flag, auto
from typing import Final

from kvpipe.pipeline import Outcome
from kvpipe.stages import FailReason, ObjectStatus, Verdict
from kvpipe.stages.integrity import REFUSED
from kvpipe.stages.object_status import FAILED_COUNT_NAMES

from .handoff import HandoffOutcome

PREFIX: Final = "kvpipe:"


class Kind(Enum):
    """What a series is in Prometheus (a counter's series name ends in ``_total``)."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Side(Flag):
    """Which role reports a metric: each connector role (process) keeps its own stats."""

    SCHEDULER = auto()
    WORKER = auto()
    EITHER = SCHEDULER | WORKER


class Keyed(Enum):
    """How a side's stats keys carry a metric's label values (how :func:`metric_of` reads them)."""

    NAME = "the key is the name (a gauge's role label comes from its reading's source)"
    PER_VALUE = "name_value: one key per value of the metric's one label"
    PER_STAGE = "name/pipeline/stage (:func:`per_stage`)"
    CALL_RECORDS = "no key: each store call's record carries operation and status"
    SAMPLES = "the key is the name; its value is a list of observations, each observed into the histogram"


@dataclass(frozen=True)
class Label:
    """A label a series carries beside vLLM's ``model_name`` and ``engine``; ``values`` when fixed."""

    name: str
    values: tuple[str, ...] = ()


@dataclass(frozen=True)
class Metric:
    """One catalogue entry: the stats key (or key family) ``name`` and what its series shows."""

    name: str
    kind: Kind
    side: Side
    help: str
    unit: str = ""
    labels: tuple[Label, ...] = ()
    keyed: Keyed = Keyed.NAME

    @property
    def series(self) -> str:
        """The series name in ``/metrics`` (a histogram's samples add ``_bucket``, ``_count``, ``_sum``)."""
        return f"{PREFIX}{self.name}_total" if self.kind is Kind.COUNTER else f"{PREFIX}{self.name}"


# -- the names: the sides' stats keys and gauge readings, the store calls' series -------------

SAVES_PLANNED: Final = "saves_planned"
SAVES_SUBMITTED: Final = "saves_submitted"
SAVES_DROPPED_NO_STAGING: Final = "saves_dropped_no_staging"
SAVE_LANDING_SECONDS: Final = "save_landing_seconds"
ENGINE_COPY_WAIT_SECONDS: Final = "engine_copy_wait_seconds"
OBJECTS: Final = "objects"
OBJECT_FAILURES: Final = "object_failures"
SAVE_JOBS: Final = "save_jobs"
SEALS_FAILED: Final = "seals_failed"
LOOKUP_CALLS: Final = "lookup_calls"
LOOKUP_HIT_TOKENS: Final = "lookup_hit_tokens"
LOOKUPS_DEFERRED: Final = "lookups_deferred"
LOOKUPS_MISSED_AFTER_FAILED_LOAD: Final = "lookups_missed_after_failed_load"
LOOKUPS_WAITED_FOR_SAVES: Final = "lookups_waited_for_saves"
HANDOFFS: Final = "handoffs"
LOADS_PLANNED: Final = "loads_planned"
LOADS_SYNC: Final = "loads_sync"
LOADS: Final = "loads"
LOADS_FAILED: Final = "loads_failed"
LOADS_FAILED_NO_STAGING: Final = "loads_failed_no_staging"
LOADS_WAITED_FOR_STAGING: Final = "loads_waited_for_staging"
LOADS_GIVEN_UP: Final = "loads_given_up"
LOADS_LAYERED: Final = "loads_layered"
SAVES_LAYERED: Final = "saves_layered"
LOADS_LAYER_LATE: Final = "loads_layer_late"
SAVES_DROPPED_FAILED_LOAD: Final = "saves_dropped_failed_load"
LOADS_SPARED: Final = "loads_spared"
CHUNKS_LOADED: Final = "chunks_loaded"
CHUNKS_LOAD_FAILED: Final = "chunks_load_failed"
CHUNKS_LOADED_FROM_OTHERS: Final = "chunks_loaded_from_others"
CHUNKS_VERIFIED: Final = "chunks_verified"
CHUNKS_UNVERIFIED: Final = "chunks_unverified"
INTEGRITY_FAILURES: Final = "integrity_failures"
EVENTS_DROPPED: Final = "events_dropped"
STAGE_DROPPED: Final = "stage_dropped"
RECORDS_DROPPED: Final = "store_operation_records_dropped"
STAGE_QUEUE_DEPTH: Final = "stage_queue_depth"
STAGING_SLOTS: Final = "staging_slots"
STAGING_SLOTS_IN_USE: Final = "staging_slots_in_use"
BREAKER_STATE: Final = "breaker_state"
OPERATION_SECONDS: Final = "store_operation_seconds"
OPERATION_KEYS: Final = "store_operation_keys"
OPERATION_BYTES: Final = "store_operation_bytes"
OPERATION_FAILED_KEYS: Final = "store_operation_failed_keys"

OPERATION_LABELS = (Label("operation", ("exist", "put", "get", "remove")), Label("status", ("ok", "error")))
STAGE_LABELS = (Label("pipeline", ("save", "load")), Label("stage"))

CATALOGUE: Final = (
    Metric(
        OPERATION_SECONDS,
        Kind.HISTOGRAM,
        Side.EITHER,
        "Time of each store call (0.1 ms .. 5 s buckets).",
        unit="seconds",
        labels=OPERATION_LABELS,
        keyed=Keyed.CALL_RECORDS,
    ),
    Metric(
        OPERATION_KEYS,
        Kind.COUNTER,
        Side.EITHER,
        "Keys the store calls asked about.",
        labels=OPERATION_LABELS,
        keyed=Keyed.CALL_RECORDS,
    ),
    Metric(
        OPERATION_BYTES,
        Kind.COUNTER,
        Side.EITHER,
        "Bytes the store calls moved (put: stored, get: read).",
        unit="bytes",
        labels=OPERATION_LABELS,
        keyed=Keyed.CALL_RECORDS,
    ),
    Metric(
        OPERATION_FAILED_KEYS,
        Kind.COUNTER,
        Side.EITHER,
        "Keys the store calls failed.",
        labels=OPERATION_LABELS,
        keyed=Keyed.CALL_RECORDS,
    ),
    Metric(
        RECORDS_DROPPED,
        Kind.COUNTER,
        Side.EITHER,
        "Store calls not recorded because the log was full (zero unless an engine stops stepping for hours).",
    ),
    Metric(
        OBJECTS,
        Kind.COUNTER,
        Side.WORKER,
        "Save-path objects by final status (throttled: not sent, the slow-store throttle skipped the put).",
        labels=(Label("status", tuple(status.value for status in ObjectStatus)),),
        keyed=Keyed.PER_VALUE,
    ),
    Metric(
        OBJECT_FAILURES,
        Kind.COUNTER,
        Side.WORKER,
        'Save-path objects that failed, by why (with `kvpipe:objects_total{status="throttled"}`, '
        '`kvpipe:saves_dropped_no_staging_total` and `kvpipe:stage_dropped_total{stage="entry"}`, every '
        "save not stored has a reason): store_error, no_space (refused after the back-off), deadline "
        "(`save_deadline_s` passed before it was sent), rolled_back (its chunk was torn), too_large, "
        "called_off (written layer by layer, its step failed: revoked unseen).",
        labels=(Label("reason", tuple(reason.value for reason in FailReason)),),
        keyed=Keyed.PER_VALUE,
    ),
    Metric(
        SAVE_JOBS,
        Kind.COUNTER,
        Side.WORKER,
        "Save jobs by outcome.",
        labels=(Label("outcome", tuple(outcome.value for outcome in Outcome)),),
        keyed=Keyed.PER_VALUE,
    ),
    Metric(
        SAVES_PLANNED,
        Kind.COUNTER,
        Side.SCHEDULER,
        "Saves the scheduler planned (chunks an engine step completed).",
    ),
    Metric(
        SAVES_SUBMITTED,
        Kind.COUNTER,
        Side.WORKER,
        "Saves a worker staged and handed to its save pipeline.",
    ),
    Metric(
        SAVES_DROPPED_NO_STAGING,
        Kind.COUNTER,
        Side.WORKER,
        "Saves dropped because no staging slot was free (a step never waits).",
    ),
    Metric(
        SAVE_LANDING_SECONDS,
        Kind.HISTOGRAM,
        Side.WORKER,
        "Per save whose every object was stored, the time from the step that computed it to stored: "
        "from then another replica's lookup finds it (`_count`: saves landed; 0.1 ms .. 5 s buckets).",
        unit="seconds",
        keyed=Keyed.SAMPLES,
    ),
    Metric(
        ENGINE_COPY_WAIT_SECONDS,
        Kind.HISTOGRAM,
        Side.WORKER,
        "Per engine step whose start waited for the last step's staging copies (a CPU cache copies on a "
        "thread of its own while the engine goes on), the seconds the engine's thread waited "
        "(`_count`: steps that waited; a device cache never waits on the thread; 0.1 ms .. 5 s buckets).",
        unit="seconds",
        keyed=Keyed.SAMPLES,
    ),
    Metric(
        STAGE_DROPPED,
        Kind.COUNTER,
        Side.WORKER,
        "Items a pipeline stage took out of the stream (the filter: objects the store already has; "
        "stage `entry`: saves refused at a full queue).",
        labels=STAGE_LABELS,
        keyed=Keyed.PER_STAGE,
    ),
    Metric(
        STAGE_QUEUE_DEPTH,
        Kind.GAUGE,
        Side.WORKER,
        "Items waiting in front of a pipeline stage, summed over ranks (read once a second).",
        labels=STAGE_LABELS,
        keyed=Keyed.PER_STAGE,
    ),
    Metric(
        STAGING_SLOTS_IN_USE,
        Kind.GAUGE,
        Side.WORKER,
        "Staging slots holding a save or a load, summed over ranks.",
    ),
    Metric(
        STAGING_SLOTS,
        Kind.GAUGE,
        Side.WORKER,
        "Staging slots, summed over ranks.",
    ),
    Metric(
        BREAKER_STATE,
        Kind.GAUGE,
        Side.EITHER,
        "The store circuit breaker of the role's worst rank: 0 closed, 1 half-open, 2 open.",
        labels=(Label("role", ("scheduler", "worker")),),
    ),
    Metric(
        LOOKUP_CALLS,
        Kind.COUNTER,
        Side.SCHEDULER,
        "Existence calls of the scheduler's lookups (one per scheduling step at most).",
    ),
    Metric(
        LOOKUP_HIT_TOKENS,
        Kind.COUNTER,
        Side.SCHEDULER,
        "Tokens lookups found in the store beyond the engine's own prefix cache.",
        unit="tokens",
    ),
    Metric(
        LOOKUPS_DEFERRED,
        Kind.COUNTER,
        Side.SCHEDULER,
        "Lookups told to ask again because another request was loading the same prefix.",
    ),
    Metric(
        LOOKUPS_WAITED_FOR_SAVES,
        Kind.COUNTER,
        Side.SCHEDULER,
        "Lookups told to ask again because chunks this engine is still saving would extend the hit.",
    ),
    Metric(
        LOADS_SPARED,
        Kind.COUNTER,
        Side.SCHEDULER,
        "Requests that waited on another request's load of their prefix and then hit it locally.",
    ),
    Metric(
        LOOKUPS_MISSED_AFTER_FAILED_LOAD,
        Kind.COUNTER,
        Side.SCHEDULER,
        "Lookups answered as misses because the request's load had failed (the engine recomputes).",
    ),
    Metric(
        HANDOFFS,
        Kind.COUNTER,
        Side.SCHEDULER,
        "Requests handed from a prefill engine to a decode engine through the store, by outcome "
        "(docs/disaggregation.md): offered (prefill: transfer parameters returned), found, waited "
        "(decode: the prefill's chunks visible at once, or after waiting), expired (the wait ran out: "
        "the rest recomputed), refused (parameters of another pool or hashing, or malformed).",
        labels=(Label("outcome", tuple(outcome.value for outcome in HandoffOutcome)),),
        keyed=Keyed.PER_VALUE,
    ),
    Metric(
        LOADS_PLANNED,
        Kind.COUNTER,
        Side.SCHEDULER,
        "Loads the scheduler sent to the workers.",
    ),
    Metric(
        LOADS_SYNC,
        Kind.COUNTER,
        Side.SCHEDULER,
        "Loads planned to run before the forward of the step that schedules their request "
        "(load_async off, or an idle engine under load_sync_when_idle), counted at allocation.",
    ),
    Metric(
        LOADS,
        Kind.COUNTER,
        Side.WORKER,
        "Loads a worker submitted (each rank counts its own).",
    ),
    Metric(
        LOADS_FAILED,
        Kind.COUNTER,
        Side.SCHEDULER,
        "Loads that failed, whole or in some of their blocks (the engine recomputes the blocks that failed).",
    ),
    Metric(
        LOADS_FAILED_NO_STAGING,
        Kind.COUNTER,
        Side.WORKER,
        "Loads failed for want of free staging slots: more than the saves in flight hold, "
        "or not given back by the load's deadline.",
    ),
    Metric(
        LOADS_WAITED_FOR_STAGING,
        Kind.COUNTER,
        Side.WORKER,
        "Loads that waited for saves to give staging slots back before they started.",
    ),
    Metric(
        LOADS_GIVEN_UP,
        Kind.COUNTER,
        Side.WORKER,
        "Loads given up at their deadline while a store call still ran (their blocks recomputed).",
    ),
    Metric(
        LOADS_LAYERED,
        Kind.COUNTER,
        Side.WORKER,
        "Loads read layer by layer while their step's forward ran (`load_layerwise`).",
    ),
    Metric(
        SAVES_LAYERED,
        Kind.COUNTER,
        Side.WORKER,
        "Saves written layer by layer as their step's forward computed them (`save_layerwise`).",
    ),
    Metric(
        LOADS_LAYER_LATE,
        Kind.COUNTER,
        Side.WORKER,
        "Layer-wise loads a layer of which had not landed when the forward reached it (its "
        "deadline passed, or the layer was never waited for): their blocks failed in that step.",
    ),
    Metric(
        SAVES_DROPPED_FAILED_LOAD,
        Kind.COUNTER,
        Side.WORKER,
        "Saves not made because their request's load failed in the same step: what the step "
        "computed over the failed blocks is recomputed, never stored.",
    ),
    Metric(
        CHUNKS_LOADED,
        Kind.COUNTER,
        Side.WORKER,
        "Chunks (one store group, one rank) loaded into the engine's blocks.",
    ),
    Metric(
        CHUNKS_LOAD_FAILED,
        Kind.COUNTER,
        Side.WORKER,
        "Chunks whose load failed.",
    ),
    Metric(
        CHUNKS_LOADED_FROM_OTHERS,
        Kind.COUNTER,
        Side.WORKER,
        "Chunks loaded that this engine did not put lately (it remembers the last it put): in a fleet, "
        "the hits another replica's saves gave it.",
    ),
    Metric(
        CHUNKS_VERIFIED,
        Kind.COUNTER,
        Side.WORKER,
        "Chunks loaded whose seal vouched for their bytes (checksum and configuration).",
    ),
    Metric(
        CHUNKS_UNVERIFIED,
        Kind.COUNTER,
        Side.WORKER,
        "Chunks loaded without a seal (vLLM's connector wrote them, or the seal was lost).",
    ),
    Metric(
        INTEGRITY_FAILURES,
        Kind.COUNTER,
        Side.WORKER,
        "Loaded chunks their seal refused, their blocks recomputed: corrupt (bytes not as sealed; removed), "
        "foreign (another configuration wrote them), unsealed (no seal under integrity: required).",
        labels=(Label("reason", tuple(sorted(verdict.value for verdict in REFUSED))),),
        keyed=Keyed.PER_VALUE,
    ),
    Metric(
        SEALS_FAILED,
        Kind.COUNTER,
        Side.WORKER,
        "Objects stored whose seal could not be stored (loads find them unverified).",
    ),
    Metric(
        EVENTS_DROPPED,
        Kind.COUNTER,
        Side.SCHEDULER,
        "KV events not published because the chunks awaiting their ranks' reports were too many.",
    ),
)
BY_NAME: Final = {metric.name: metric for metric in CATALOGUE}


def per_value(family: str, value: str) -> str:
    """The stats key of one label value of a :attr:`Keyed.PER_VALUE` metric: ``objects_put``."""
    return f"{family}_{value}"


def per_stage(family: str, pipeline: str, stage: str) -> str:
    """The stats key of one stage's figure of a :attr:`Keyed.PER_STAGE` metric: ``family/pipeline/stage``."""
    return f"{family}/{pipeline}/{stage}"


#: what the worker counts each stored object, each completed save job, each loaded chunk under:
#: keys made once, so the per-object count is one dict update (an enum's ``.value`` is a slow property)
OBJECTS_BY_STATUS: Final = {status: per_value(OBJECTS, status.value) for status in ObjectStatus}
SAVE_JOBS_BY_OUTCOME: Final = {outcome: per_value(SAVE_JOBS, outcome.value) for outcome in Outcome}
#: a save job's count of each reason's failed objects -> the stats key it is reported under
FAILED_BY_JOB_COUNT: Final = {
    name: per_value(OBJECT_FAILURES, reason.value) for reason, name in FAILED_COUNT_NAMES.items()
}
HANDOFFS_BY_OUTCOME: Final = {outcome: per_value(HANDOFFS, outcome.value) for outcome in HandoffOutcome}
CHUNKS_BY_VERDICT: Final = {
    Verdict.VERIFIED: CHUNKS_VERIFIED,
    Verdict.UNVERIFIED: CHUNKS_UNVERIFIED,
    **{verdict: per_value(INTEGRITY_FAILURES, verdict.value) for verdict in REFUSED},
}

_BY_KEY: Final[dict[str, tuple[Metric, tuple[str, ...]]]] = {
    **{m.name: (m, ()) for m in CATALOGUE if m.keyed in (Keyed.NAME, Keyed.SAMPLES)},
    **{
        per_value(m.name, value): (m, (value,))
        for m in CATALOGUE
        if m.keyed is Keyed.PER_VALUE
        for value in m.labels[0].values
    },
}


def metric_of(key: str) -> tuple[Metric, tuple[str, ...]] | None:
    """The metric a stats key or gauge reading counts under, with the label values the key names.

    None: a key the catalogue does not know (a test holds the sides to the catalogue).
    """
    found = _BY_KEY.get(key)
    if found is not None:
        return found
    family, *stage = key.split("/", 2)
    metric = BY_NAME.get(family)
    if metric is None or metric.keyed is not Keyed.PER_STAGE or len(stage) != 2:
        return None
    return metric, tuple(stage)


def markdown_table() -> str:
    """docs/vllm-connector.md's metrics table, a row per entry (``python -m kvpipe.connector.vllm.metrics`` prints it)."""
    rows = [
        "| series | type | labels | unit | reported by | what it shows |",
        "|---|---|---|---|---|---|",
    ]
    for metric in CATALOGUE:
        labels = ", ".join(
            f"`{label.name}` ({', '.join(label.values)})" if label.values else f"`{label.name}`"
            for label in metric.labels
        )
        side = " or ".join(str(side.name).lower() for side in Side if side in metric.side)  # one-bit flags
        rows.append(
            f"| `{metric.series}` | {metric.kind.value} | {labels} | {metric.unit} | {side} | {metric.help} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
