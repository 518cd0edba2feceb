"""A settings model's validation error, as the command-line flag that set the field would say it."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError


def flag_error(error: ValidationError, renames: Mapping[str, str] | None = None) -> str:
    """``--flag: problem, got value`` for the first problem of ``error``.

    A field's flag is its name with dashes (``store_nodes`` -> ``--store-nodes``),
    unless ``renames`` gives the flag's name for it (``{"global_segment_size": "segment"}``).
    """
    problem = error.errors()[0]
    field = str(problem["loc"][0]) if problem["loc"] else ""
    flag = "--" + (renames or {}).get(field, field).replace("_", "-")
    message = problem["msg"] if ", got " in problem["msg"] else f"{problem['msg']}, got {problem['input']!r}"
    return f"{flag}: {message}"
