"""What crosses vLLM's process boundaries: the per-step metadata, the connector stats, chunk reports.

:class:`KVPipeStats` goes from each role to vLLM's logger process (the API server
with ``vllm serve``), where :mod:`.prom` turns it into Prometheus series. Its
``data`` is plain JSON-able values, in three kinds that aggregate differently:

- counters, ``name -> int``: growth since the role's last report; summed;
- lists: ``"ops"``, the store calls' records (:data:`~kvpipe.connector.store.metered.OperationRecord`
  as lists), and a histogram's observations (``save_landing_seconds``, ``engine_copy_wait_seconds``); concatenated;
- ``"gauges"``: ``source -> {name: value}``, the latest reading of each role
  (``"scheduler"``, ``"worker:<tp>:<pp>"``); merged, a later reading replacing an
  earlier one of the same source, so readings of several ranks never add up twice.

:class:`KVPipeKVEvents` carries the workers' chunk reports to the scheduler, which
turns the chunks every rank stored into vLLM's KV events (:mod:`.events`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpipe.stages import LoadRequest, SaveRequest

OPS = "ops"
GAUGES = "gauges"


@dataclass
class KVPipeMetadata(KVConnectorMetadata):
    """One step's work: the loads to start, the saves to make after the forward (engine block ids).

    A load whose request id is in ``sync_loads`` must have landed before the
    forward; the others run beside the steps and are reported by ``get_finished``.
    """

    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[SaveRequest] = field(default_factory=list)
    sync_loads: set[str] = field(default_factory=set)


@dataclass
class KVPipeStats(KVConnectorStats):
    """Counters, store-call records and gauge readings since the last report (see the module docstring)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(name, []).extend(value)
            elif name == GAUGES:
                self.data.setdefault(GAUGES, {}).update(value)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's periodic log line shows: the counters, observations' count and mean, and per
        operation calls, mean time, failed keys."""
        reduced: dict[str, int | float] = {}
        for name, value in self.data.items():
            if name in (OPS, GAUGES):
                continue
            if isinstance(value, list):
                reduced[f"{name}_count"] = len(value)
                reduced[f"{name}_mean"] = round(fmean(value), 4) if value else 0.0
            else:
                reduced[name] = value
        by_operation: dict[str, list[list[Any]]] = {}
        for record in self.data.get(OPS, ()):
            by_operation.setdefault(record[0], []).append(record)
        for operation, records in sorted(by_operation.items()):
            reduced[f"{operation}_calls"] = len(records)
            reduced[f"{operation}_avg_ms"] = round(fmean(r[2] for r in records) * 1e3, 3)
            reduced[f"{operation}_failed_keys"] = sum(r[5] for r in records)
        return reduced

    def is_empty(self) -> bool:
        return not any(value for name, value in self.data.items())


#: One rank's word on one chunk of one save: (tp key rank, pp rank, chunk hash, every object stored).
ChunkReport = tuple[int, int, bytes, bool]

#: A rank that puts, as chunk reports name it: (tp key rank, pp rank)
Rank = tuple[int, int]


def chunk_settled(reported: set[Rank], report: ChunkReport, ranks: frozenset[Rank]) -> bool | None:
    """Add ``report`` to the ranks that stored its chunk; whether that settles the chunk.

    True: every rank in ``ranks`` has stored it, so a reader can load it whole.
    False: this rank did not store it, so no reader can, whatever the others report.
    None: still open.
    """
    tp, pp, _, stored = report
    if not stored:
        return False
    reported.add((tp, pp))
    return True if ranks <= reported else None


class KVPipeKVEvents(KVConnectorKVEvents):
    """The workers' chunk reports of one step, on their way to the scheduler.

    vLLM combines the workers' containers (``add_events``) before the scheduler
    sees them; the reports name their rank, so the scheduler needs no worker
    count: a chunk is announced once every rank that puts has reported it stored.
    """

    def __init__(self, reports: list[ChunkReport] | None = None) -> None:
        self.reports: list[ChunkReport] = list(reports or ())

    def add_events(self, events: list[Any]) -> None:
        self.reports.extend(events)

    def aggregate(self) -> KVPipeKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        return None  # reports carry their rank

    def get_all_events(self) -> list[Any]:
        return list(self.reports)

    def get_number_of_workers(self) -> int:
        return len({(tp, pp) for tp, pp, _, _ in self.reports})

    def clear_events(self) -> None:
        self.reports.clear()
