"""What crosses vLLM's process boundaries: the per-step metadata and the connector stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpipe.stages import LoadRequest, SaveRequest


@dataclass
class KVPipeMetadata(KVConnectorMetadata):
    """One step's work: loads to run before the forward, saves after it (engine block ids)."""

    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[SaveRequest] = field(default_factory=list)


@dataclass
class KVPipeStats(KVConnectorStats):
    """Counters since the last report (saves submitted/dropped, objects put/existing/failed, loads)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
