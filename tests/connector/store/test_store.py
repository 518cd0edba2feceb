"""The run-time probe for ``group_ids``, against configs old, new and real."""

from __future__ import annotations

import pytest
from mooncake.store import ReplicateConfig

from kvpipe.connector.store.memory import LegacyReplicateConfig, MemoryReplicateConfig
from kvpipe.connector.store.protocol import replicate_config_supports_group_ids


class PerInstance:
    def __init__(self) -> None:
        self.group_ids: list[str] | None = None


@pytest.mark.parametrize(
    ("config_cls", "supported"),
    [(MemoryReplicateConfig, True), (PerInstance, True), (LegacyReplicateConfig, False)],
    ids=["class-property", "instance-attribute", "older-mooncake"],
)
def test_group_ids_support_is_read_off_the_config(config_cls: type, supported: bool) -> None:
    assert replicate_config_supports_group_ids(config_cls, config_cls()) is supported


def test_the_installed_mooncake_supports_group_ids() -> None:
    assert replicate_config_supports_group_ids(ReplicateConfig, ReplicateConfig())
