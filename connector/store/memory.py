"""An in-process Mooncake Store: the facts of docs/mooncake-store-behaviour.md, with real bytes.

Stage and pipeline tests need a store that behaves like the real one where it
matters (per-key codes, put-of-existing is a no-op, leases granted by reads,
watermark eviction of whole groups, soft pins, the group-id rules) without a master
process, and that can be made to fail on demand. :class:`MemoryStore` is that
model; the store contract suite runs against it and the real store alike, which
is what keeps it faithful.

Deliberate simplifications: eviction runs inside the put that needs the room
(the real master evicts in the background, so it may first answer -200, and
past the watermark it may even take an object just put before the read that
would lease it; the model never does), there is one copy whatever
``replica_num`` says, and puts and gets do not require registered buffers (the
real store accepts unregistered ones on the local memcpy path too).
Registration itself follows the real client: a range that overlaps a
registered one, an empty one or address 0 is -600, and only the start of a
registration unregisters it. Negative sizes or pointers raise TypeError, as the
real client's bindings do before any call is made. One deliberate strictness:
a get whose pointer and size lists differ in length fails that key with -600,
where the real client pairs them up silently.

Calls come from worker threads, so all state sits behind one lock; injected
latency and stalls sleep outside it, as a slow network would not block the
other callers.
"""

from __future__ import annotations

import ctypes
import math
import random
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from kvpipe.stages.store import MAX_SOFT_PIN_TTL_S, Code

from .protocol import replicate_config_supports_group_ids

__all__ = [
    "Faults",
    "LegacyReplicateConfig",
    "MemoryReplicateConfig",
    "MemoryStore",
    "Op",
    "Outage",
    "StoreStats",
]

Op = Literal["exist", "put", "get"]
Outage = Literal["none", "down", "stalled"]
_OPS: tuple[str, ...] = get_args(Op)
_OUTAGES: tuple[str, ...] = get_args(Outage)


@dataclass(frozen=True)
class Faults:
    """What should go wrong, and how often. Replace ``store.faults`` to change it mid-run.

    ``error_rates``: op -> {code: probability per key}; a key that draws a code
    returns it and, for a put, is not stored. ``latency_s``: op -> seconds each
    call sleeps. ``outage``: ``"down"`` fails every key of every master call
    with -900 at once (a killed master); ``"stalled"`` sleeps ``stall_s`` and
    then fails them with -901 (a stopped master, whose RPCs time out).
    Draws come from ``random.Random(seed)``, so a single-threaded run repeats.
    """

    error_rates: dict[str, dict[int, float]] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    outage: Outage = "none"
    stall_s: float = 0.0
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for op, rates in self.error_rates.items():
            _check_op("error_rates", op)
            for code, p in rates.items():
                key: object = code  # a YAML file or caller outside mypy can pass any key
                if not isinstance(key, int) or key >= 0:
                    raise ValueError(f"error_rates[{op!r}]: codes must be negative ints, got {code!r}")
                if not 0.0 <= p <= 1.0:
                    raise ValueError(f"error_rates[{op!r}][{code}] must be in [0, 1], got {p!r}")
            if sum(rates.values()) > 1.0:
                raise ValueError(f"error_rates[{op!r}]: probabilities sum to more than 1, got {rates!r}")
        for op, seconds in self.latency_s.items():
            _check_op("latency_s", op)
            if not seconds >= 0.0:
                raise ValueError(f"latency_s[{op!r}] must be >= 0, got {seconds!r}")
        if self.outage not in _OUTAGES:
            raise ValueError(f"outage must be one of {_OUTAGES}, got {self.outage!r}")
        if not self.stall_s >= 0.0:
            raise ValueError(f"stall_s must be >= 0, got {self.stall_s!r}")
        object.__setattr__(self, "_rng", random.Random(self.seed))

    def draw(self, op: Op) -> int | None:
        """The code one key of ``op`` fails with, or None. Not thread-safe: the store locks."""
        rates = self.error_rates.get(op)
        if not rates:
            return None
        draw = self._rng.random()
        for code, p in rates.items():
            if draw < p:
                return code
            draw -= p
        return None


def _check_op(what: str, op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"{what}: op must be one of {_OPS}, got {op!r}")


class LegacyReplicateConfig:
    """A replicate config of a Mooncake release before group ids: no ``group_ids`` at all.

    Slotted like the pybind11 class, so ``config.group_ids = [...]`` raises
    AttributeError instead of silently adding an attribute nobody reads.
    """

    __slots__ = ("replica_num",)

    def __init__(self, replica_num: int = 1) -> None:
        self.replica_num = replica_num


class MemoryReplicateConfig(LegacyReplicateConfig):
    """Mooncake's ``ReplicateConfig`` with ``group_ids``, down to its pybind11 manners.

    Assigning validates (a sequence of str, else TypeError) and reading returns
    a copy, exactly as the real property does: ``config.group_ids.append(id)``
    changes nothing, on either store.
    """

    __slots__ = ("_group_ids", "soft_pin_ttl_ms")

    def __init__(
        self, replica_num: int = 1, group_ids: Sequence[str] | None = None, soft_pin_ttl_ms: int | None = None
    ) -> None:
        super().__init__(replica_num)
        self.group_ids = group_ids
        self.soft_pin_ttl_ms = soft_pin_ttl_ms  # None: not pinned (Mooncake's soft_pin_action ENABLE + TTL)

    @property
    def group_ids(self) -> list[str] | None:
        return None if self._group_ids is None else list(self._group_ids)

    @group_ids.setter
    def group_ids(self, value: Sequence[str] | None) -> None:
        if value is None:
            self._group_ids: tuple[str, ...] | None = None
            return
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError(f"group_ids must be a list of str or None, got {value!r}")
        if not all(isinstance(g, str) for g in value):
            raise TypeError(f"group_ids must hold only str, got {list(value)!r}")
        self._group_ids = tuple(value)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of a :class:`MemoryStore` for tests and reports."""

    objects: int
    groups: int
    bytes_used: int
    capacity_bytes: int
    evicted_objects: int
    evicted_bytes: int


@dataclass(slots=True)
class _Object:
    data: bytearray
    group: str | None
    lease_until: float = -math.inf
    pinned_until: float = -math.inf  # a soft pin: evicted only when nothing unpinned can be


class MemoryStore:
    """A thread-safe, in-process model of Mooncake Store (see the module docstring).

    ``capacity_bytes`` plays the master's mounted segments, ``high_watermark``
    and ``eviction_ratio`` its eviction flags, ``lease_ttl_s`` its
    ``--default_kv_lease_ttl``. ``group_ids_supported=False`` presents an older
    Mooncake whose replicate config has no ``group_ids``. ``clock`` drives
    leases only (tests pass a fake one); latency and stalls use real sleeps.
    """

    def __init__(
        self,
        capacity_bytes: int = 1 << 30,
        *,
        high_watermark: float = 0.95,
        eviction_ratio: float = 0.05,
        lease_ttl_s: float = 5.0,
        group_ids_supported: bool = True,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        size: object = capacity_bytes  # checked at run time too: callers outside mypy can pass anything
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if not 0.0 < high_watermark <= 1.0:
            raise ValueError(f"high_watermark must be in (0, 1], got {high_watermark!r}")
        if not 0.0 <= eviction_ratio <= 1.0:
            raise ValueError(f"eviction_ratio must be in [0, 1], got {eviction_ratio!r}")
        if not lease_ttl_s >= 0.0:
            raise ValueError(f"lease_ttl_s must be >= 0, got {lease_ttl_s!r}")
        if faults is not None and not isinstance(faults, Faults):
            raise ValueError(f"faults must be a Faults or None, got {faults!r}")
        if not callable(clock):
            raise ValueError(f"clock must be callable, got {clock!r}")
        self.faults = faults or Faults()
        self._capacity = capacity_bytes
        self._high_watermark = high_watermark
        self._eviction_ratio = eviction_ratio
        self._lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._config_cls = MemoryReplicateConfig if group_ids_supported else LegacyReplicateConfig
        self._supports_group_ids = replicate_config_supports_group_ids(self._config_cls, self._config_cls())
        self._lock = threading.Lock()
        self._objects: OrderedDict[str, _Object] = OrderedDict()  # least recently used first
        self._groups: dict[str, set[str]] = {}
        self._registered: dict[int, int] = {}
        # get sessions: key -> the object as its session found it (a removed one is still read, as the
        # real client reads the replica it was told of)
        self._sessions: dict[str, _Object] = {}
        # put sessions: key -> the object being written, its room taken, invisible until its end
        self._pending: dict[str, _Object] = {}
        self._used = 0
        self._evicted_objects = 0
        self._evicted_bytes = 0
        self._closed = False

    # -- the SavingStore calls -------------------------------------------------------------

    @property
    def supports_group_ids(self) -> bool:
        return self._supports_group_ids

    @property
    def local_transfers(self) -> bool:
        return True  # puts are memcpy into this process

    def new_replicate_config(self, *, soft_pin_ttl_ms: int | None = None) -> LegacyReplicateConfig:
        config = self._config_cls()
        if isinstance(config, MemoryReplicateConfig):  # a release before group ids had no pins either
            config.soft_pin_ttl_ms = soft_pin_ttl_ms
        return config

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        if (failed := self._unavailable("exist", len(keys))) is not None:
            return failed
        with self._lock:
            now = self._clock()
            return [self._exist_one(key, now) for key in keys]

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        config: LegacyReplicateConfig,
    ) -> list[int]:
        if type(config) is not self._config_cls:
            raise TypeError(
                f"config must come from this store's new_replicate_config() "
                f"({self._config_cls.__name__}), got {type(config).__name__}"
            )
        group_ids = config.group_ids if isinstance(config, MemoryReplicateConfig) else None
        pin_ms = config.soft_pin_ttl_ms if isinstance(config, MemoryReplicateConfig) else None
        _check_unsigned(ptrs, sizes)
        if (
            not _same_lengths(keys, ptrs, sizes)
            or any(len(p) != len(s) for p, s in zip(ptrs, sizes, strict=True))
            or (group_ids is not None and len(group_ids) != len(keys))  # `[]` too
            or (pin_ms is not None and not 0 <= pin_ms <= MAX_SOFT_PIN_TTL_S * 1000)  # the master refuses it
        ):
            return [Code.INVALID_PARAMS] * len(keys)
        if (failed := self._unavailable("put", len(keys))) is not None:
            return failed
        with self._lock:
            stored: set[str] = set()
            pinned_until = -math.inf if pin_ms is None else self._clock() + pin_ms / 1000
            return [
                self._put_one(
                    key, key_ptrs, key_sizes, group_ids[i] if group_ids else "", stored, pinned_until
                )
                for i, (key, key_ptrs, key_sizes) in enumerate(zip(keys, ptrs, sizes, strict=True))
            ]

    # -- the rest of the Store protocol ----------------------------------------------------

    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
    ) -> list[int]:
        _check_unsigned(ptrs, sizes)
        if not _same_lengths(keys, ptrs, sizes):
            return [Code.INVALID_PARAMS] * len(keys)
        if (failed := self._unavailable("get", len(keys))) is not None:
            return failed
        with self._lock:
            now = self._clock()
            return [self._get_one(key, p, s, now) for key, p, s in zip(keys, ptrs, sizes, strict=True)]

    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        if (failed := self._unavailable("exist", len(keys))) is not None:
            return failed
        with self._lock:
            now = self._clock()
            results: list[int] = []
            for key in keys:
                obj = self._read(key, now)
                if obj is not None:
                    self._sessions[key] = obj
                results.append(Code.NOT_FOUND if obj is None else Code.OK)
            return results

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        return self._ranged("get", self._sessions, keys, ptrs, sizes, offsets)

    def _ranged(
        self,
        op: Op,
        open_: dict[str, _Object],
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """A ranged ``op`` (get: the object's bytes into the buffers; put: the other way) on keys ``open_`` holds."""
        _check_unsigned(ptrs, sizes)
        if not _same_lengths(keys, ptrs, sizes, offsets):
            return [Code.INVALID_PARAMS] * len(keys)
        if (failed := self._unavailable(op, len(keys))) is not None:
            return failed
        with self._lock:
            return [
                self._ranges(op, open_.get(key), key_ptrs, key_sizes, key_offsets)
                for key, key_ptrs, key_sizes, key_offsets in zip(keys, ptrs, sizes, offsets, strict=True)
            ]

    def _ranges(
        self, op: Op, obj: _Object | None, ptrs: Sequence[int], sizes: Sequence[int], offsets: Sequence[int]
    ) -> int:
        if obj is None or not len(ptrs) == len(sizes) == len(offsets):
            return Code.INVALID_PARAMS  # the real client's answer to a key with no session
        if (code := self.faults.draw(op)) is not None:
            return code
        if any(offset < 0 or offset + size > len(obj.data) for offset, size in zip(offsets, sizes, strict=True)):
            return Code.INVALID_PARAMS
        base = _address(obj.data)
        for ptr, size, offset in zip(ptrs, sizes, offsets, strict=True):
            if op == "get":
                ctypes.memmove(ptr, base + offset, size)
            else:
                ctypes.memmove(base + offset, ptr, size)
        return sum(sizes)

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        with self._lock:
            for key in keys:
                self._sessions.pop(key, None)
        return Code.OK

    def batch_put_session_start(
        self, keys: Sequence[str], sizes: Sequence[int], config: LegacyReplicateConfig
    ) -> list[int]:
        group_ids = config.group_ids if isinstance(config, MemoryReplicateConfig) else None
        pin_ms = config.soft_pin_ttl_ms if isinstance(config, MemoryReplicateConfig) else None
        if not _same_lengths(keys, sizes) or (group_ids is not None and len(group_ids) != len(keys)):
            return [Code.INVALID_PARAMS] * len(keys)
        if (failed := self._unavailable("put", len(keys))) is not None:
            return failed
        with self._lock:
            pinned_until = -math.inf if pin_ms is None else self._clock() + pin_ms / 1000
            results: list[int] = []
            for index, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                if key in self._objects:
                    results.append(Code.ALREADY_EXISTS)
                elif key in self._pending or size <= 0:
                    results.append(Code.INVALID_PARAMS)
                elif size > self._capacity or not self._make_room(size, protected=()):
                    results.append(Code.NO_SPACE)
                else:
                    group = (group_ids[index] if group_ids else "") or None
                    self._pending[key] = _Object(bytearray(size), group, pinned_until=pinned_until)
                    self._used += size
                    results.append(Code.OK)
            return results

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        return self._ranged("put", self._pending, keys, ptrs, sizes, offsets)

    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        if (failed := self._unavailable("put", len(keys))) is not None:
            return failed
        with self._lock:
            results: list[int] = []
            for key in keys:
                obj = self._pending.pop(key, None)
                if obj is None:
                    results.append(Code.INVALID_PARAMS)
                    continue
                self._visible(key, obj)  # as written: the store does not check every byte was
                results.append(Code.OK)
            return results

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        if (failed := self._unavailable("put", len(keys))) is not None:
            return failed
        with self._lock:
            results: list[int] = []
            for key in keys:
                obj = self._pending.pop(key, None)
                if obj is not None:
                    self._used -= len(obj.data)
                results.append(Code.INVALID_PARAMS if obj is None else Code.OK)
            return results

    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], config: LegacyReplicateConfig
    ) -> list[int]:
        return self.batch_put_from_multi_buffers(keys, [[p] for p in ptrs], [[s] for s in sizes], config)

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return self.batch_get_into_multi_buffers(keys, [[p] for p in ptrs], [[s] for s in sizes])

    def get_size(self, key: str) -> int:
        if (failed := self._unavailable(None, 1)) is not None:
            return failed[0]
        with self._lock:
            obj = self._read(key, self._clock())
            return Code.NOT_FOUND if obj is None else len(obj.data)

    def remove(self, key: str, *, force: bool = False) -> int:
        if (failed := self._unavailable(None, 1)) is not None:
            return failed[0]
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return Code.NOT_FOUND
            if obj.lease_until > self._clock() and not force:
                return Code.HAS_LEASE
            self._drop(key)
            return Code.OK

    def remove_all(self) -> int:
        if (failed := self._unavailable(None, 1)) is not None:
            return failed[0]
        with self._lock:
            now = self._clock()
            expired = [key for key, obj in self._objects.items() if obj.lease_until <= now]
            for key in expired:
                self._drop(key)
            return len(expired)

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        if (failed := self._unavailable(None, 1)) is not None:
            return failed[0]
        matches = re.compile(pattern).search
        with self._lock:
            now = self._clock()
            chosen = [
                key
                for key, obj in self._objects.items()
                if matches(key) and (force or obj.lease_until <= now)
            ]
            for key in chosen:
                self._drop(key)
            return len(chosen)

    def register_buffer(self, addr: int, nbytes: int) -> int:
        _check_unsigned([[addr]], [[nbytes]])
        with self._lock:
            if self._closed:
                return Code.RPC_FAILED
            if nbytes == 0 or addr == 0:
                return Code.INVALID_PARAMS
            end = addr + nbytes
            if any(start < end and addr < start + n for start, n in self._registered.items()):
                return Code.INVALID_PARAMS  # overlaps a registration, as the real client refuses
            self._registered[addr] = nbytes
            return Code.OK

    def unregister_buffer(self, addr: int) -> int:
        with self._lock:
            if self._closed:
                return Code.RPC_FAILED
            return Code.OK if self._registered.pop(addr, None) is not None else Code.INVALID_PARAMS

    def capacity_bytes(self) -> int | None:
        """``capacity_bytes``, as given: this model is the whole store."""
        return self._capacity

    def close(self) -> None:
        with self._lock:
            self._closed = True

    # -- for tests and reports -------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                objects=len(self._objects),
                groups=len(self._groups),
                bytes_used=self._used,
                capacity_bytes=self._capacity,
                evicted_objects=self._evicted_objects,
                evicted_bytes=self._evicted_bytes,
            )

    # -- internals -------------------------------------------------------------------------

    def _unavailable(self, op: Op | None, n_keys: int) -> list[int] | None:
        """Every key's code if the master cannot answer this call, else None.

        Sleeps (latency, stall) happen here, before the lock is taken.
        """
        faults = self.faults
        if self._closed or faults.outage == "down":
            return [Code.RPC_FAILED] * n_keys
        if faults.outage == "stalled":
            time.sleep(faults.stall_s)
            return [Code.RPC_TIMEOUT] * n_keys
        if op is not None and (delay := faults.latency_s.get(op, 0.0)) > 0.0:
            time.sleep(delay)
        return None

    def _exist_one(self, key: str, now: float) -> int:
        if (code := self.faults.draw("exist")) is not None:
            return code
        return 0 if self._read(key, now) is None else 1

    def _put_one(
        self,
        key: str,
        ptrs: Sequence[int],
        sizes: Sequence[int],
        group_id: str,
        stored: set[str],
        pinned_until: float = -math.inf,
    ) -> int:
        if not key or not sizes or sum(sizes) <= 0:
            return Code.INVALID_PARAMS  # empty buffers are fine, empty objects are not
        if (code := self.faults.draw("put")) is not None:
            return code
        if key in self._objects or key in self._pending:
            return Code.OK  # the first value stays; so does its group
        size = sum(sizes)
        if size > self._capacity or not self._make_room(size, protected=stored):
            return Code.NO_SPACE
        data = bytearray(size)
        _copy(_address(data), ptrs, sizes, into_buffers=False)
        self._used += size
        self._visible(key, _Object(data, group_id or None, pinned_until=pinned_until))
        stored.add(key)
        return Code.OK

    def _visible(self, key: str, obj: _Object) -> None:
        """``obj`` (its room taken) is stored under ``key`` from now on, in its group."""
        self._objects[key] = obj
        if obj.group is not None:
            self._groups.setdefault(obj.group, set()).add(key)

    def _get_one(self, key: str, ptrs: Sequence[int], sizes: Sequence[int], now: float) -> int:
        if len(ptrs) != len(sizes):
            return Code.INVALID_PARAMS
        if (code := self.faults.draw("get")) is not None:
            return code
        obj = self._read(key, now)
        if obj is None:
            return Code.NOT_FOUND
        size = len(obj.data)
        wanted = sum(sizes)
        if wanted < size:
            return Code.INVALID_PARAMS
        if wanted > size:
            return Code.TRANSFER_FAILED
        _copy(_address(obj.data), ptrs, sizes, into_buffers=True)
        return size

    def _members(self, key: str, obj: _Object) -> Collection[str]:
        """The keys that are leased and evicted together with ``key``."""
        return (key,) if obj.group is None else self._groups[obj.group]

    def _read(self, key: str, now: float) -> _Object | None:
        """Look ``key`` up as a reader: lease its whole group and mark it recently used."""
        obj = self._objects.get(key)
        if obj is not None:
            for member in self._members(key, obj):
                self._objects[member].lease_until = now + self._lease_ttl_s
                self._objects.move_to_end(member)
        return obj

    def _make_room(self, size: int, protected: Collection[str]) -> bool:
        """Evict for a put of ``size`` bytes if it crosses the watermark; whether it fits.

        Victims are whole groups (or ungrouped objects), least recently used
        first, with no member leased and none stored earlier in the same call;
        soft-pinned ones only once no unpinned victim is left (Mooncake's
        ``--allow_evict_soft_pinned_objects``, on by default).
        """
        limit = self._high_watermark * self._capacity
        if self._used + size > limit:
            target = max(self._eviction_ratio * self._capacity, self._used + size - limit)
            now = self._clock()
            freed = 0
            for pins_too in (False, True):
                for key in list(self._objects):
                    if freed >= target:
                        break
                    obj = self._objects.get(key)
                    if obj is None:
                        continue  # went with its group
                    unit = list(self._members(key, obj))
                    if any(k in protected or self._objects[k].lease_until > now for k in unit):
                        continue
                    if not pins_too and any(self._objects[k].pinned_until > now for k in unit):
                        continue
                    freed += self._evict(unit)
        return self._used + size <= self._capacity

    def _evict(self, unit: Collection[str]) -> int:
        freed = sum(self._drop(k) for k in unit)
        self._evicted_objects += len(unit)
        self._evicted_bytes += freed
        return freed

    def _drop(self, key: str) -> int:
        """Forget one object; returns its size."""
        obj = self._objects.pop(key)
        self._used -= len(obj.data)
        if obj.group is not None:
            members = self._groups[obj.group]
            members.discard(key)
            if not members:
                del self._groups[obj.group]
        return len(obj.data)


def _check_unsigned(ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> None:
    """TypeError for a negative pointer or size: the real client's bindings take only unsigned ints."""
    for values in (*ptrs, *sizes):
        for value in values:
            if value < 0:
                raise TypeError(f"pointers and sizes must be unsigned ints, got {value!r}")


def _same_lengths(keys: Sequence[str], *per_key: Sequence[object]) -> bool:
    return all(len(column) == len(keys) for column in per_key)


def _copy(base: int, ptrs: Sequence[int], sizes: Sequence[int], *, into_buffers: bool) -> None:
    """Copy between the object at ``base`` and its buffers, which tile it in order."""
    offset = 0
    for ptr, n in zip(ptrs, sizes, strict=True):
        dst, src = (ptr, base + offset) if into_buffers else (base + offset, ptr)
        ctypes.memmove(dst, src, n)
        offset += n


def _address(data: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
