"""What every command shares: the user's error (one line, exit 2) and the checks that raise it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError

from kvpipe.connector.run.config import RunConfig, apply_override
from kvpipe.connector.store.configs import without_store_tag
from kvpipe.pipeline import BuildError
from kvpipe.pipeline.config import describe_validation_error, load_yaml, one_line

#: the exit code of input the user can fix
USAGE_ERROR = 2


class UsageError(Exception):
    """Input the user can fix; shown as one line, exit code 2."""


def load_run_config(path: Path, overrides: Sequence[str]) -> RunConfig:
    """The validated config: the file, then each ``--set``; UsageError naming the place otherwise."""
    try:
        document = load_yaml(path) or {}
    except BuildError as error:
        raise UsageError(str(error)) from None
    if not isinstance(document, dict):
        kind = type(document).__name__
        raise UsageError(f"{path}: must be a mapping of sections (store, model, workload, ...), got a {kind}")
    for assignment in overrides:
        try:
            apply_override(document, assignment)
        except ValueError as error:
            raise UsageError(str(error)) from None
    try:
        return RunConfig.model_validate(document)
    except ValidationError as error:
        raise UsageError(
            f"{path}: {one_line(describe_validation_error(error, '', without_store_tag))}"
        ) from None


def check_file_to_write(flag: str, path: Path) -> None:
    """Refuse, before any work, a file that could not be written after it."""
    if path.is_dir():
        raise UsageError(f"{flag}: {str(path)!r} is a folder, not a file")
    if not path.parent.is_dir():
        raise UsageError(f"{flag}: folder {str(path.parent)!r} does not exist")


def flagged(flag: str, load: Callable[[], RunConfig]) -> RunConfig:
    """``load()``, its UsageError prefixed with the flag that named the file."""
    try:
        return load()
    except UsageError as error:
        raise UsageError(f"{flag}: {error}") from None
