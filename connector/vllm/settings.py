"""``kv_connector_extra_config``: the connector's settings, validated, with YAML defaults."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvpipe.stages import StrictFlag
from kvpipe.stages.flags import ConfigError

from ..stores import StoreConfig


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config``, validated; errors name the field and the value."""

    model_config = ConfigDict(extra="forbid")

    store: StoreConfig | None = None
    enable_group_semantics: StrictFlag = False
    cache_prefix: str = ""
    queue_capacity: int = Field(1024, gt=0)
    max_buffers_per_call: int = Field(2048, gt=0)
    staging_blocks: int = Field(256, gt=0)
    config: str | None = None


def settings_from(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """Validate ``extra`` (defaults from the ``config`` YAML's ``store``/``save`` sections)."""
    extra = dict(extra or {})
    document: dict[str, Any] = {}
    if extra.get("config"):
        path = Path(str(extra["config"]))
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"kv_connector_extra_config.config: cannot read {str(path)!r}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"kv_connector_extra_config.config: {str(path)!r} must hold a mapping")
        if "store" in loaded:
            document["store"] = loaded["store"]
        save = loaded.get("save") or {}
        known = set(ConnectorSettings.model_fields) - {"store", "config"}
        document.update({k: v for k, v in save.items() if k in known})
    document.update(extra)
    try:
        return ConnectorSettings.model_validate(document)
    except ValidationError as exc:
        lines = []
        for problem in exc.errors():
            where = ".".join(str(part) for part in problem["loc"])
            lines.append(f"kv_connector_extra_config.{where}: {problem['msg']}, got {problem['input']!r}")
        raise ConfigError("\n".join(lines)) from None
