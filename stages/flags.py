"""Strict parsing of boolean switches from configuration.

vLLM reads ``enable_group_semantics`` as ``str(v).strip().lower() == "true"``, so a
typo such as ``"flase"`` or ``"yes"`` silently means *off*. Here a flag is a real
boolean or the word true/false (any case, trimmed); anything else is a
configuration error that names the field and the value.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, ValidationInfo

from .errors import ConfigError


def parse_flag(value: object, field: str) -> bool:
    """``True``/``False`` as they are, ``"true"``/``"false"`` in any case; else :class:`ConfigError`.

    Numbers are refused on purpose, 1 included: ``1.5`` has no boolean meaning,
    and accepting ``1`` but not ``2`` would be a rule nobody remembers.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "false"):
            return word == "true"
    raise ConfigError(f"{field}: expected true or false, got {value!r}")


def _validate_flag(value: object, info: ValidationInfo) -> bool:
    return parse_flag(value, info.field_name or "flag")


#: A pydantic field type with :func:`parse_flag`'s rules; errors name the field.
StrictFlag = Annotated[bool, BeforeValidator(_validate_flag)]
