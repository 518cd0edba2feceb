"""Settings models filled from command-line flags, their validation errors said as the flags would."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class FlagError(ValueError):
    """A flag's value the settings refuse: ``--flag: problem, got value``."""


def from_flags(
    model: type[Model], values: Mapping[str, object], renames: Mapping[str, str] | None = None
) -> Model:
    """``model`` from the flags' ``values`` by field name (``None``: not given, the model's default).

    :raises FlagError: naming the flag of the first field refused. A field's flag is its
        name with dashes (``store_nodes`` -> ``--store-nodes``), unless ``renames`` gives
        the flag's name for it (``{"global_segment_size": "segment"}``).
    """
    try:
        return model.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as error:
        problem = error.errors()[0]
        field = str(problem["loc"][0]) if problem["loc"] else ""
        flag = "--" + (renames or {}).get(field, field).replace("_", "-")
        message = (
            problem["msg"] if ", got " in problem["msg"] else f"{problem['msg']}, got {problem['input']!r}"
        )
        raise FlagError(f"{flag}: {message}") from None
