"""The store backends' contract: Mooncake Store's batch API, as kvpipe uses it.

Every backend (the in-process model in :mod:`.memory`, the real Mooncake client)
satisfies :class:`Store`. It is Mooncake's own Python API on purpose: the real
client then needs no translation layer, and the model can be held to the real
store by running one contract test suite against both.

The primitives, and why each is here:

``batch_is_exist(keys)``
    1 / 0 / negative per key. The save path asks once per batch which objects
    the store already has, so nothing is copied twice. A positive answer also
    grants the object a read lease, so an object just found is not evicted
    before a get reaches it. A negative code means "don't know", never "absent".
``batch_put_from_multi_buffers(keys, ptrs, sizes, config)``
    The object of a key is its buffers concatenated: a KV block is one buffer
    per layer, and copying them into one staging buffer first would double the
    traffic. Putting a key that exists returns 0 and keeps the first value, so
    retries and racing writers are harmless.
``batch_get_into_multi_buffers(keys, ptrs, sizes)``
    The load path's mirror: bytes read or a negative code. The destination's
    total size must equal the object's; its split into buffers is free.
``batch_get_session_start(keys)`` / ``batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets)`` / ``batch_get_session_end(keys)``
    Layer-wise loads (docs/layerwise.md): an object's bytes are its layers in
    order, so a layer is a byte range of it, read into that layer's buffers while
    the engine computes the layers before it. A session asks the master for the
    replicas once; each ranged get is then a transfer only. Ranged gets refuse
    (-600) a key with no session, and a session is one per key per client: the
    first end closes it for every reader (callers count their own users).
``batch_put_session_start(keys, sizes, config)`` / ``batch_put_from_multi_buffer_ranges(keys, ptrs, sizes, offsets)`` / ``batch_put_session_end(keys)`` / ``batch_put_session_revoke(keys)``
    Layer-wise saves: an object is reserved (invisible), written a layer at a
    time while the engine computes the next, and made visible at its end, or
    revoked; a writer that dies leaves nothing a reader can see, and the master
    drops its reservation after ``--put_start_discard_timeout_sec``. The end does
    not check that every byte was written: the writer must.
``batch_put_from`` / ``batch_get_into``
    The one-buffer-per-object forms, for callers that already hold contiguous
    objects.
``get_size(key)``
    An object's size without reading it (-704 if missing); a read, so it
    leases the object too.
``remove(key)`` / ``remove_all()``
    Cleanup for tests, benchmarks and operators. Leased objects stay:
    ``remove`` returns -706 on them and ``remove_all`` skips them (it returns
    how many it removed).
``remove_by_regex(pattern, force)``
    Remove the objects whose key the pattern *searches* (not full-matches:
    anchor it with ``^``), leased ones too with ``force``; how many went, or
    negative. One master call: a scoped reset removes one deployment's objects
    without listing the store, and never another deployment's.
``register_buffer(addr, nbytes)`` / ``unregister_buffer(addr)``
    The transfer engine may only touch registered memory, so the KV caches are
    registered once at start-up, not per call.
``new_replicate_config()``
    A fresh config per put call; a shared, mutated one races when puts overlap.
    Its ``group_ids`` (one per key, ``""`` for none) tie objects into groups
    that are leased and evicted as one.
``supports_group_ids``
    Older Mooncake releases have no ``group_ids``. Backends compute this with
    :func:`replicate_config_supports_group_ids`, so the probe exists once.
``capacity_bytes()``
    The bytes of objects the store's memory holds (every mounted segment, whoever
    mounted it), or None when this client cannot tell. Asked once, where a default
    is sized from the store (retention's pin budget, docs/retention.md), not on the
    data path.
``close()``
    Releases the client; later calls fail with -900, as RPCs to a gone master do.

Results are per key and never exceptions (see :mod:`kvpipe.stages.store` for
the codes); the only raises are programming errors, such as a non-string group id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from kvpipe.stages.store import LoadingStore, SavingStore

__all__ = [
    "ForwardingStore",
    "Operation",
    "Sizes",
    "Store",
    "StoreCall",
    "replicate_config_supports_group_ids",
]

#: What a wrapper's hook sees a call as: the three the data path makes, and cleanup.
Operation = Literal["exist", "put", "get", "remove"]
#: A put's buffer sizes, per key; and a master call, answering per key.
Sizes = Sequence[Sequence[int]]
StoreCall = Callable[[], list[int]]


@runtime_checkable
class Store(SavingStore, LoadingStore, Protocol):
    """What a backend implements: the save and load roles, plus single-buffer calls and housekeeping."""

    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], config: Any
    ) -> list[int]:
        """Store each key from one contiguous buffer. Per key: 0 or negative."""
        ...

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Read each object into one contiguous buffer. Per key: bytes read or negative."""
        ...

    def get_size(self, key: str) -> int:
        """The object's size in bytes, or -704 if it is missing. Leases the object."""
        ...

    def remove_all(self) -> int:
        """Remove every object that is not leased; returns how many were removed."""
        ...

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        """Remove the objects whose key ``pattern`` searches (leased too if ``force``): how many, or negative."""
        ...

    def capacity_bytes(self) -> int | None:
        """The bytes of objects the store's memory holds, all segments together; None: unknown here."""
        ...

    def close(self) -> None:
        """Release the client. Idempotent; later calls return -900."""
        ...


def replicate_config_supports_group_ids(config_cls: type, config_instance: object) -> bool:
    """Whether this Mooncake build's replicate config has ``group_ids``.

    Asked at run time because the attribute arrived in a later release than
    some deployments run. The class is asked first (a pybind11 property lives
    there); the instance covers configs that only set the attribute per object.
    """
    if hasattr(config_cls, "group_ids"):
        return True
    return hasattr(config_instance, "group_ids")


class ForwardingStore:
    """A :class:`Store` that hands every call to ``inner``; master calls pass one hook.

    Wrappers (the circuit breaker, the operation meter) override :meth:`_call`
    only, so each of them sees every store call the data path makes, and none
    restates the protocol. Local calls (buffer registration, capabilities,
    close, a get session's end), ``remove_all`` and ``capacity_bytes`` go straight through.
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    @property
    def supports_group_ids(self) -> bool:
        return self.inner.supports_group_ids

    @property
    def local_transfers(self) -> bool:
        return self.inner.local_transfers

    def new_replicate_config(self, *, soft_pin_ttl_ms: int | None = None) -> Any:
        return self.inner.new_replicate_config(soft_pin_ttl_ms=soft_pin_ttl_ms)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return self._call("exist", len(keys), None, lambda: self.inner.batch_is_exist(keys))

    def batch_put_from_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], config: Any
    ) -> list[int]:
        return self._call(
            "put",
            len(keys),
            sizes,
            lambda: self.inner.batch_put_from_multi_buffers(keys, ptrs, sizes, config),
        )

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        return self._call(
            "get", len(keys), None, lambda: self.inner.batch_get_into_multi_buffers(keys, ptrs, sizes)
        )

    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        return self._call("exist", len(keys), None, lambda: self.inner.batch_get_session_start(keys))

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        return self._call(
            "get",
            len(keys),
            None,
            lambda: self.inner.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets),
        )

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        return self.inner.batch_get_session_end(keys)

    def batch_put_session_start(self, keys: Sequence[str], sizes: Sequence[int], config: Any) -> list[int]:
        return self._call("put", len(keys), None, lambda: self.inner.batch_put_session_start(keys, sizes, config))

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        return self._call(
            "put",
            len(keys),
            sizes,
            lambda: self.inner.batch_put_from_multi_buffer_ranges(keys, ptrs, sizes, offsets),
        )

    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        return self._call("put", len(keys), None, lambda: self.inner.batch_put_session_end(keys))

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        return self._call("remove", len(keys), None, lambda: self.inner.batch_put_session_revoke(keys))

    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], config: Any
    ) -> list[int]:
        return self._call(
            "put",
            len(keys),
            [[size] for size in sizes],
            lambda: self.inner.batch_put_from(keys, ptrs, sizes, config),
        )

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return self._call("get", len(keys), None, lambda: self.inner.batch_get_into(keys, ptrs, sizes))

    def get_size(self, key: str) -> int:
        return self._call("exist", 1, None, lambda: [self.inner.get_size(key)])[0]

    def remove(self, key: str, *, force: bool = False) -> int:
        return self._call("remove", 1, None, lambda: [self.inner.remove(key, force=force)])[0]

    def remove_all(self) -> int:
        return self.inner.remove_all()

    def capacity_bytes(self) -> int | None:
        return self.inner.capacity_bytes()

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return self._call("remove", 1, None, lambda: [self.inner.remove_by_regex(pattern, force)])[0]

    def register_buffer(self, addr: int, nbytes: int) -> int:
        return self.inner.register_buffer(addr, nbytes)

    def unregister_buffer(self, addr: int) -> int:
        return self.inner.unregister_buffer(addr)

    def close(self) -> None:
        self.inner.close()

    def _call(self, operation: Operation, n_keys: int, sizes: Sizes | None, call: StoreCall) -> list[int]:
        """Run one master call (per key codes); ``sizes`` are a put's buffers. Subclasses wrap it."""
        return call()
