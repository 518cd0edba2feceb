"""Choosing and opening a store from configuration: ``store: {kind: memory | mooncake, ...}``.

Either kind takes ``breaker: {failures_to_open, open_s}`` (or ``null`` to go
without): the opened store is wrapped in a :class:`~.breaker.GuardedStore`,
so a master that stops answering costs a few timed-out calls, not one per save.

A backend is one config class with a ``kind`` tag, ``open`` and ``lent_bytes``
(:class:`BackendConfig`), registered by naming it in :data:`AnyStoreConfig`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal, Protocol, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from .breaker import BreakerSettings, CircuitBreaker, GuardedStore
from .memory import MemoryStore
from .metered import MeteredStore, OperationLog
from .mooncake.client import MooncakeStore
from .mooncake.settings import MooncakeSettings, parse_size
from .protocol import Store

#: what the ``breaker`` key of either store kind sets (its fields' own meaning; breaker.py)
BREAKER_HELP = (
    "The circuit breaker the store is opened behind: after `failures_to_open` calls in a row that all came "
    "back -900/-901 (master unreachable), calls fail at once; a probe after `open_s` closes it again. "
    "null: no breaker."
)

#: what a mooncake ``store:`` section's ``vllm_config`` key does (read before validation, so no field)
VLLM_CONFIG_HELP = (
    "Read vLLM's Mooncake JSON file at this path (the one `MOONCAKE_CONFIG_PATH` names) for the fields "
    "above; keys given beside it override the file's."
)

#: A size in bytes: an int or a string such as "256MB" (binary units, as vLLM reads them).
Size = Annotated[int, BeforeValidator(parse_size), Field(gt=0)]
#: The same, where 0 means "none".
ByteCount = Annotated[int, BeforeValidator(parse_size), Field(ge=0)]


class MemoryStoreConfig(BaseModel):
    """The in-process model of Mooncake: for demos and fast tests."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["memory"] = Field("memory", description="The in-process model of Mooncake Store.")
    capacity: Size = Field(1 << 30, description="Bytes the store holds (the master's mounted segments).")
    high_watermark: float = Field(
        0.95, gt=0, le=1, description="Share of `capacity` past which a put first evicts (oldest read first)."
    )
    eviction_ratio: float = Field(
        0.05, gt=0, le=1, description="Share of `capacity` one eviction frees at least."
    )
    lease_ttl_s: float = Field(
        5.0, ge=0, description="Seconds a read leases an object (a leased one is not evicted)."
    )
    group_ids_supported: bool = Field(
        True, description="false: present as a Mooncake whose replicate config has no `group_ids`."
    )
    breaker: BreakerSettings | None = Field(default_factory=BreakerSettings, description=BREAKER_HELP)

    def open(self, *, mount_segment: bool = True, shared: bool = False) -> MemoryStore:
        """A new in-process store (it has no client to share, no segment to leave out)."""
        return MemoryStore(
            self.capacity,
            high_watermark=self.high_watermark,
            eviction_ratio=self.eviction_ratio,
            lease_ttl_s=self.lease_ttl_s,
            group_ids_supported=self.group_ids_supported,
        )

    def lent_bytes(self) -> int:
        """All of it: the store lives in the process that opens it."""
        return self.capacity


class MooncakeStoreConfig(MooncakeSettings):
    """The real Mooncake client (a spawned local master by default).

    ``vllm_config: PATH`` reads the JSON file vLLM's own connector uses (the one
    ``MOONCAKE_CONFIG_PATH`` names); fields given beside it override the file's. It is
    no field (the file becomes the fields): :data:`VLLM_CONFIG_HELP` documents it.
    """

    kind: Literal["mooncake"] = Field("mooncake", description="The real Mooncake client.")
    breaker: BreakerSettings | None = Field(default_factory=BreakerSettings, description=BREAKER_HELP)

    def settings(self) -> MooncakeSettings:
        """The client's own settings: this config without the kvpipe-side fields."""
        return MooncakeSettings.model_validate(self.model_dump(exclude={"kind", "breaker"}))

    def open(self, *, mount_segment: bool = True, shared: bool = False) -> MooncakeStore:
        """A client of the configured master (see :func:`connect`; raises what it raises)."""
        settings = self.settings()
        if not mount_segment:
            settings = settings.model_copy(update={"global_segment_size": 0})
        return MooncakeStore.open_shared(settings) if shared else MooncakeStore.open(settings)

    def lent_bytes(self) -> int:
        """The segment this client mounts into the store."""
        return self.global_segment_size

    @model_validator(mode="before")
    @classmethod
    def _from_vllm_file(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "vllm_config" not in data:
            return data
        ours = {k: data[k] for k in ("breaker",) if k in data}
        overrides = {k: v for k, v in data.items() if k not in ("kind", "vllm_config", *ours)}
        settings = MooncakeSettings.from_vllm_file(data["vllm_config"], **overrides)
        return {"kind": "mooncake", **settings.model_dump(), **ours}


class BackendConfig(Protocol):
    """What every backend's config is: a ``kind`` tag, a breaker, and how to open its store."""

    @property
    def kind(self) -> str:
        """The tag that names the backend in a ``store:`` section."""
        ...

    @property
    def breaker(self) -> BreakerSettings | None:
        """The circuit breaker the store is opened behind (None: without)."""
        ...

    def open(self, *, mount_segment: bool = True, shared: bool = False) -> Store:
        """The store, open (``mount_segment``, ``shared``: see :func:`connect`)."""
        ...

    def lent_bytes(self) -> int:
        """The memory a process that opens it lends the store."""
        ...


#: Every backend's config: the one registration a new backend needs.
AnyStoreConfig = MemoryStoreConfig | MooncakeStoreConfig
#: A ``store:`` section, told apart by its ``kind``.
StoreConfig = Annotated[AnyStoreConfig, Field(discriminator="kind")]
_KINDS = frozenset(get_args(config.model_fields["kind"].annotation)[0] for config in get_args(AnyStoreConfig))


def without_store_tag(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """``store.memory.capacity`` -> ``store.capacity``: the kind is already in the file."""
    if len(loc) > 1 and loc[0] == "store" and loc[1] in _KINDS:
        return (loc[0], *loc[2:])
    return loc


def connect(
    config: BackendConfig,
    *,
    mount_segment: bool = True,
    shared: bool = False,
    log: OperationLog | None = None,
) -> Store:
    """The configured store, open and behind its breaker: the one way kvpipe opens a store.

    ``mount_segment=False`` opens a Mooncake client that lends the store no memory
    (``global_segment_size: 0``), for a process that only asks what exists.
    ``shared=True`` takes the process's client for the same settings if one is open
    (:meth:`~.mooncake.client.MooncakeStore.open_shared`). ``log`` records every call
    that reaches the store (:mod:`.metered`). The caller closes the store.

    :raises ~.mooncake.master.MasterError: the master (or metadata server) cannot be
        started or reached within ``connect_timeout_s`` (one line).
    :raises ~.mooncake.client.MooncakeError: the Mooncake client cannot be loaded (the
        extra or ``libibverbs1`` missing) or its ``setup()`` fails (naming the code).
    """
    return guarded(config.open(mount_segment=mount_segment, shared=shared), config.breaker, log)


@contextmanager
def open_store(config: BackendConfig) -> Iterator[Store]:
    """The configured store (:func:`connect`), closed (and a spawned master stopped) on exit.

    Raises what :func:`connect` raises.
    """
    store = connect(config)
    try:
        yield store
    finally:
        store.close()


def guarded(store: Store, breaker: BreakerSettings | None, log: OperationLog | None = None) -> Store:
    """``store`` behind a circuit breaker (None: without), its calls recorded into ``log`` if given.

    The meter sits inside the breaker: it times the calls the store answered,
    and the calls the breaker refused show as its state, not as fast "calls".
    """
    if log is not None:
        store = MeteredStore(store, log)
    return store if breaker is None else GuardedStore(store, CircuitBreaker(breaker))
