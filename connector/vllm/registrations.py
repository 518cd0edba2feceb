"""The memory a worker registers with its store, and lets go of for vLLM's sleep mode.

A worker registers its staging arena and, on CPU, the engine's KV storages (the
store then reads and writes the engine's blocks). vLLM's sleep mode frees the
engine's storages: they are unregistered before and registered again after it
(the same addresses); the arena is host memory that sleep keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import structlog

from kvpipe.connector.store.protocol import Store

log = structlog.get_logger("kvpipe.connector.vllm")


class BufferRegistrations:
    """One worker's registrations with its store: what is registered now, and which of it is the engine's."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._registered: list[int] = []  # addresses, in registration order
        self._engine: dict[int, int] = {}  # the engine's storages: address -> bytes
        self._released = False  # sleep mode has the engine's storages

    @property
    def released(self) -> bool:
        """Whether the engine's storages are let go of (:meth:`release_engine`, not yet restored)."""
        return self._released

    def register(self, storages: Mapping[int, int], *, engine: bool = False) -> None:
        """Register ``storages`` (address -> bytes); ``engine``: the engine's, which sleep mode frees."""
        if engine:
            self._engine.update(storages)
        for address, nbytes in storages.items():
            code = self._store.register_buffer(address, nbytes)
            if code != 0:
                log.warning("register_buffer failed", address=hex(address), nbytes=nbytes, code=code)
            else:
                self._registered.append(address)

    def release_engine(self) -> None:
        """Unregister the engine's storages before sleep mode frees them."""
        self._released = True
        self.unregister(list(self._engine))

    def restore_engine(self) -> None:
        """Register the engine's storages again after vLLM's wake-up."""
        self._released = False
        self.register(self._engine)

    def unregister(self, addresses: Sequence[int] | None = None) -> None:
        """Unregister ``addresses`` (None: every registration) where they are registered.

        A store that is closing refuses with a code: its segment goes with it, so
        nothing is lost and it is only noted. Anything else a client raises is
        logged, and the other addresses are still unregistered.
        """
        for address in list(self._registered) if addresses is None else addresses:
            if address not in self._registered:
                continue
            self._registered.remove(address)
            try:
                code = self._store.unregister_buffer(address)
            except Exception as exc:  # noqa: BLE001 - a native client's error must not stop the others
                log.warning("unregister_buffer failed", address=hex(address), error=repr(exc))
                continue
            if code != 0:
                log.info("unregister_buffer refused", address=hex(address), code=code)
