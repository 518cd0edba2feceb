"""What a ``kvpipe run`` should have stored, regenerated; and the key-name store both that and chunk counts use.

Why: absent chunks are knowable only from a list of the chunks that should be
stored, and a run's list is exactly what its job offers to save. The job itself is
replayed against :class:`KeyNames`, a store that holds only key names, so the list
is the job's, chunk by chunk, without touching a real store.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpipe.connector.store.protocol import Store, replicate_config_supports_group_ids
from kvpipe.pipeline.config import one_line
from kvpipe.stages import StoreObject
from kvpipe.stages.store import Code

from .errors import InspectError

if TYPE_CHECKING:
    from kvpipe.connector.run.config import RunConfig

__all__ = ["ExpectedRun", "KeyNames", "client_supports_group_ids", "expected_objects", "replay_run"]


@dataclass(frozen=True)
class ExpectedRun:
    """What a ``kvpipe run`` config says the store should hold.

    ``config``: its path, as the report names it; ``objects``: every object its job
    offers to save (:func:`expected_objects`); ``requests_group_ids``:
    whether the run asks for group semantics.
    """

    config: str
    objects: Sequence[StoreObject]
    requests_group_ids: bool


@dataclass
class _ReplicateConfig:
    """A replicate config's fields, for puts that go nowhere."""

    replica_num: int = 1
    group_ids: list[str] | None = None


class KeyNames(Store):
    """A :class:`~kvpipe.connector.store.protocol.Store` that holds only key names.

    The names exist, nothing else does, and puts write nothing: the job and
    :func:`~kvpipe.connector.run.check.count_chunks` run on it unchanged, so a run replays without
    touching any store, and chunks are counted against a listing with the run
    report's own rule. Reads find nothing (-704), removals remove nothing.
    """

    def __init__(self, names: Iterable[str] = (), *, supports_group_ids: bool = False) -> None:
        self._names = frozenset(names)
        self._supports_group_ids = supports_group_ids

    @property
    def supports_group_ids(self) -> bool:
        return self._supports_group_ids

    @property
    def local_transfers(self) -> bool:
        return True  # nothing is transferred: never gather

    def new_replicate_config(self, *, soft_pin_ttl_ms: int | None = None) -> _ReplicateConfig:
        return _ReplicateConfig()

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return [1 if key in self._names else 0 for key in keys]

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        config: object,
    ) -> list[int]:
        return [0] * len(keys)

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        return [Code.NOT_FOUND] * len(keys)

    def batch_put_session_start(self, keys: Sequence[str], sizes: Sequence[int], config: object) -> list[int]:
        return [0] * len(keys)

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        return [sum(per_key) for per_key in sizes]

    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        return [0] * len(keys)

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        return [0] * len(keys)

    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        return [Code.NOT_FOUND] * len(keys)

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        return [Code.INVALID_PARAMS] * len(keys)

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        return 0

    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], config: object
    ) -> list[int]:
        return [0] * len(keys)

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return [Code.NOT_FOUND] * len(keys)

    def get_size(self, key: str) -> int:
        return Code.NOT_FOUND

    def remove(self, key: str, *, force: bool = False) -> int:
        return Code.NOT_FOUND

    def remove_all(self) -> int:
        return 0

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return 0

    def capacity_bytes(self) -> int | None:
        return None  # names only: no memory to speak of

    def register_buffer(self, addr: int, nbytes: int) -> int:
        return 0

    def unregister_buffer(self, addr: int) -> int:
        return 0

    def close(self) -> None:
        pass  # holds no client


def client_supports_group_ids() -> bool | None:
    """Whether the installed Mooncake client's ReplicateConfig has ``group_ids``; None without the wheel."""
    try:
        # by name: the native binding ships no stubs (mypy reports that at whichever import it reads first)
        config_cls: type = importlib.import_module("mooncake.store").ReplicateConfig
    except ImportError:
        return None
    return replicate_config_supports_group_ids(config_cls, config_cls())


def expected_objects(config: RunConfig) -> list[StoreObject]:
    """Every object ``kvpipe run`` with ``config`` offers to save, regenerated; nothing is written.

    The job itself runs (same workload from the same seed, same engine stand-in,
    same save pipeline) against :class:`KeyNames` holding nothing, so the records are
    exactly the job's, chunk by chunk. It costs what the job costs without a store:
    its KV cache in memory (``kv_cache_bytes``) and the engine's steps (about a
    second for the shipped configs).

    :raises ValueError: the config cannot run (``model.num_blocks`` too small, and the like).
    """
    from kvpipe.connector.run.job import run

    result = run(config, store=KeyNames(supports_group_ids=bool(client_supports_group_ids())))
    return [record for record, _ in result.objects.values()]


def replay_run(config: RunConfig, path: Path) -> ExpectedRun:
    """What the run config ``config``, read from ``path``, should have stored: its job replayed.

    :raises InspectError: (``run``) the config cannot run; the message names ``path``.
    """
    try:
        objects = expected_objects(config)
    except ValueError as error:
        raise InspectError("run", f"{path}: {one_line(str(error))}") from None
    return ExpectedRun(str(path), objects, bool(config.save.enable_group_semantics))
