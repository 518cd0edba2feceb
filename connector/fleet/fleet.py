"""A local fleet: one Mooncake store, N ``vllm serve`` replicas sharing it, vLLM's router in front.

What a fleet is for: a prefix one replica computed is a hit on every other, so a
router may balance load without cache affinity. :class:`Fleet` starts, on this
machine:

1. the store: a spawned master (``masters: 1``) or an HA group of masters on etcd
   (``masters: 2+``), and ``store_nodes`` ``kvpipe store`` processes that hold the
   objects (replicas mount no segment, so a replica's death loses nothing stored);
2. ``replicas`` ``vllm serve`` processes on one model with kvpipe's connector,
   vLLM's ``MooncakeStoreConnector`` (same store, for comparison) or none; a
   dummy-weight model folder gets a word-level tokenizer (:mod:`.tokenizer`) so
   text clients work with no download;
3. vLLM's router over them with a load-balancing ``policy``.

Its :attr:`Fleet.url` is the one address clients use. Leaving the ``with`` block
(normally, on an error, on Ctrl-C, on SIGTERM where :func:`sigterm_unwinds` holds)
stops every process it started, router first, store last; an error while starting
stops what had started.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from enum import StrEnum
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field

from kvpipe.connector.bench import launch
from kvpipe.connector.store.mooncake.cluster import LocalCluster, StoreNodeProcess
from kvpipe.connector.store.mooncake.master import LocalMaster

from .replica import POLICIES, Served, replica, router
from .tokenizer import write_tokenizer


class Contender(StrEnum):
    """Which connector the replicas load."""

    KVPIPE = "kvpipe"
    VLLM = "vllm"  # vLLM's own MooncakeStoreConnector
    NONE = "none"


class FleetSpec(BaseModel):
    """What :class:`Fleet` starts. Errors name the field and the value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(2, ge=1, le=16)
    connector: Contender = Contender.KVPIPE
    policy: str = Field("round_robin", pattern="^(" + "|".join(POLICIES) + ")$")
    masters: int = Field(1, ge=1, le=5)
    store_nodes: int = Field(1, ge=1, le=16)
    node_segment: str = "512MB"
    copies: int = Field(1, ge=1, le=16)  # Mooncake replicas of each object (kvpipe's store.replicas)
    model: Path | None = None  # a model folder (default: the tiny Llama, dummy weights)
    max_model_len: int = Field(2048, gt=0)
    kv_cache_memory_bytes: int = Field(64 << 20, gt=0)
    connector_settings: dict[str, Any] = Field(default_factory=dict)  # kvpipe's extra config
    replica_args: tuple[str, ...] = ()  # more ``vllm serve`` arguments
    router_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    startup_timeout_s: float = Field(300.0, gt=0)


class Fleet:
    """The processes of a :class:`FleetSpec`, started on enter and stopped on exit."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.model = spec.model or launch.model_dir("tiny-llama", launch.TINY_LLAMA)
        self.log_dir = spec.log_dir or Path(tempfile.mkdtemp(prefix="kvpipe-fleet-"))
        self.replicas: list[Served] = []
        self.router: Served | None = None
        self.master: LocalMaster | None = None
        self.cluster: LocalCluster | None = None
        self.store_nodes: list[StoreNodeProcess] = []
        self._stack = ExitStack()

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()  # in reverse: router, replicas, store nodes, masters

    def _start(self) -> None:
        spec = self.spec
        self.log_dir.mkdir(parents=True, exist_ok=True)
        write_tokenizer(self.model, int(json.loads((self.model / "config.json").read_text())["vocab_size"]))
        self._start_store()
        transfer, env = self._connector()
        self.replicas = [
            replica(
                f"replica {i}",
                self.model,
                self.log_dir / f"replica-{i}.log",
                transfer=transfer,
                env=env,
                max_model_len=spec.max_model_len,
                kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
                extra_args=spec.replica_args,
            )
            for i in range(spec.replicas)
        ]
        for served in self.replicas:  # side by side: each start is mostly waiting
            self._stack.callback(served.stop)
            served.start()
        for served in self.replicas:
            served.wait_ready(spec.startup_timeout_s)
        self.router = router([r.url for r in self.replicas], spec.policy, self.log_dir, spec.router_args)
        self._stack.callback(self.router.stop)
        self.router.start()
        self.router.wait_ready(60.0)

    def _start_store(self) -> None:
        spec = self.spec
        if spec.masters > 1:
            self.cluster = self._stack.enter_context(
                LocalCluster(spec.masters, store_nodes=spec.store_nodes, node_segment=spec.node_segment)
            )
            self.store_nodes = self.cluster.store_nodes
            return
        self.master = self._stack.enter_context(LocalMaster())
        assert self.master.endpoints is not None
        metrics = [f"{self.master.endpoints.host}:{self.master.endpoints.metrics_port}"]
        for _ in range(spec.store_nodes):
            node = StoreNodeProcess(
                self.master.endpoints.master_address, segment=spec.node_segment, metrics=metrics
            )
            self._stack.callback(node.stop)
            self.store_nodes.append(node)

    def _connector(self) -> tuple[dict[str, Any] | None, dict[str, str]]:
        """The replicas' ``--kv-transfer-config`` and environment for the chosen connector."""
        address = self.store_address
        if self.spec.connector is Contender.KVPIPE:
            store = {**launch.store_section(address), "replicas": self.spec.copies}
            return launch.kvpipe_transfer({"store": store, **self.spec.connector_settings}), {}
        if self.spec.connector is Contender.VLLM:
            path = self.log_dir / "mooncake.json"
            path.write_text(json.dumps(launch.vllm_mooncake_config(address)))
            return launch.mooncake_transfer(), launch.vllm_mooncake_env(path)
        return None, {}

    # -- what clients and tests read -----------------------------------------------------

    @property
    def store_address(self) -> launch.StoreAddress:
        """The master(s) and metadata server every replica's store client joins."""
        if self.cluster is not None:
            return self.cluster
        assert self.master is not None and self.master.endpoints is not None
        return self.master.endpoints

    @property
    def url(self) -> str:
        """The router's address: the one URL clients use."""
        if self.router is None:
            raise RuntimeError("the fleet is not running")
        return self.router.url

    def processes(self) -> Iterator[int]:
        """The pids of every process the fleet started and still runs (for a test that none outlives it)."""
        for served in [*self.replicas, *([self.router] if self.router else [])]:
            yield from (p.pid for p in served.process.survivors())
        for node in self.store_nodes:
            if node.pid is not None:
                yield node.pid
        if self.master is not None and self.master.pid is not None:
            yield self.master.pid
        if self.cluster is not None:
            yield from self.cluster.pids
