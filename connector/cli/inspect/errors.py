"""The one error ``kvpipe inspect`` reports: which input leads to no report, and why, in one line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvpipe.connector.store.mooncake.admin import AdminError

__all__ = ["InspectError", "admin_errors"]


class InspectError(ValueError):
    """An input that does not lead to a report; ``field`` names it (``master``, ``metrics``, ``model``, ``run``,
    ``verify``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@contextmanager
def admin_errors() -> Iterator[None]:
    """Report a failing admin HTTP as the input that named it (``metrics``).

    :raises InspectError: (``metrics``) in place of an :class:`AdminError` raised inside, same message.
    """
    try:
        yield
    except AdminError as error:
        raise InspectError("metrics", str(error)) from None
