"""What this process's Mooncake clients share: the one place kvpipe keeps process-wide state.

Mooncake's client is made to be one per process, and three facts outlive any one store:

- **the shared clients**: :meth:`~.client.MooncakeStore.open_shared` hands one client per
  settings to every asker (a vLLM engine's scheduler and worker), so two clients of one HA
  cluster do not follow a new leader at different times;
- **the etcd cluster joined**: the library keeps one etcd client per process and refuses a
  second ("Etcd client already connected to ..."), so a second etcd cluster is refused
  here, as one line, before ``setup()``;
- **the environment the user set**: the library reads its deadlines from the environment
  (:mod:`.environment`), and a store leaves its transfer deadline there for good, so what
  the user exported is told apart from what kvpipe wrote by the environment as the first
  store found it.

:data:`REGISTRY` is the one instance; nothing else in the package keeps module-level state.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from .master import MasterError
from .master_address import MasterAddress

if TYPE_CHECKING:
    from .client import MooncakeStore
    from .settings import MooncakeSettings


class ProcessRegistry:
    """The process-wide state of Mooncake clients (see the module docstring); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: the clients open_shared hands out, by their settings (a closed one is replaced)
        self._shared: dict[MooncakeSettings, MooncakeStore] = {}
        #: the etcd endpoints this process's clients joined, once one has
        self.joined_etcd: tuple[tuple[str, int], ...] | None = None
        self._user_environment: dict[str, str] | None = None
        self._environment_lock = threading.Lock()  # its own: taken by an open under shared_stores

    @contextmanager
    def shared_stores(self) -> Iterator[dict[MooncakeSettings, MooncakeStore]]:
        """The shared clients by their settings, held for one look-up-or-open (not re-entrant)."""
        with self._lock:
            yield self._shared

    def forget(self, key: MooncakeSettings, store: MooncakeStore) -> None:
        """Drop ``store`` from the shared clients if it is the one ``key`` names.

        Takes no lock: a closing store calls it under its own, which :meth:`shared_stores`'s
        holder may be waiting for (one dict operation is atomic).
        """
        if self._shared.get(key) is store:
            del self._shared[key]

    def refuse_second_etcd(self, address: MasterAddress) -> None:
        """Nothing, unless ``address`` is an etcd cluster other than the one this process joined.

        :raises MasterError: this process joined another etcd cluster already (one line).
        """
        joined = self.joined_etcd
        if address.kind != "etcd" or joined is None or joined == address.endpoints:
            return
        raise MasterError(
            f"this process joined the mooncake cluster at etcd://{_endpoints_text(joined)} already: "
            f"Mooncake's client keeps one etcd connection per process, so "
            f"etcd://{_endpoints_text(address.endpoints)} needs a process of its own"
        )

    def joined(self, address: MasterAddress) -> None:
        """Record a client set up on ``address``: the first etcd cluster is this process's."""
        if address.kind == "etcd" and self.joined_etcd is None:
            self.joined_etcd = address.endpoints

    def user_environment(self) -> Mapping[str, str]:
        """The environment as the first store of this process found it, before kvpipe wrote to it."""
        with self._environment_lock:
            if self._user_environment is None:
                self._user_environment = dict(os.environ)
            return self._user_environment


def _endpoints_text(endpoints: tuple[tuple[str, int], ...]) -> str:
    return ";".join(f"{host}:{port}" for host, port in endpoints)


#: the process's registry
REGISTRY = ProcessRegistry()
