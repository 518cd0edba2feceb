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
   text clients work with no download; each replica's engine threads are bound to
   cores of its own (``bind_cores``: replicas that share cores spin against each
   other, see :func:`~.replica.core_shares`);
3. vLLM's router over them with a load-balancing ``policy``; with ``prefill`` and
   ``decode`` engines instead of whole-request replicas, the router in
   prefill/decode mode: each request is prefilled on one engine and decoded on
   another, the KV cache passing through the store (docs/disaggregation.md); for ``kv_aware``, the
   replicas publish vLLM's KV events and a :class:`~.pool_relay.PoolRelay` gives every
   worker the shared pool's events (kvpipe's), so a chunk one replica stored is
   credited to every replica at the router's external tier.

With ``network_namespaces`` each replica and store node runs in a network namespace
of its own on a bridge, the master and the router on the bridge's address
(:mod:`.network`), so a partition can be made (:meth:`.network.Network.cut`).

Its :attr:`Fleet.url` is the one address clients use. Leaving the ``with`` block
(normally, on an error, on Ctrl-C, on SIGTERM where :func:`sigterm_unwinds` holds)
stops every process it started, router first, store last; an error while starting
stops what had started.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvpipe.connector.engines import launch
from kvpipe.connector.store.mooncake.cluster import LocalCluster, StoreNodeProcess
from kvpipe.connector.store.mooncake.master import LOOPBACK, LocalMaster, MasterEndpoints, free_ports

from .network import Host, Network
from .replica import POLICIES, Served, core_shares, ranks_of, replica, router, thread_binding
from .tokenizer import write_tokenizer

if TYPE_CHECKING:
    from .pool_relay import PoolRelay

#: the router answers within seconds; replicas take most of a fleet's start
ROUTER_READY_S = 60.0


class Contender(StrEnum):
    """Which connector the replicas load."""

    KVPIPE = "kvpipe"
    VLLM = "vllm"  # vLLM's own MooncakeStoreConnector
    NONE = "none"


class FleetSpec(BaseModel):
    """What :class:`Fleet` starts. Errors name the field and the value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(2, ge=1, le=16)
    # Prefill and decode on different engines: the first ``prefill`` replicas prefill (kv_both:
    # they serve prefix hits too), the next ``decode`` decode (kv_consumer), the router in
    # prefill/decode mode. Both 0: every replica serves whole requests. ``replicas`` follows.
    prefill: int = Field(0, ge=0, le=16)
    decode: int = Field(0, ge=0, le=16)
    connector: Contender = Contender.KVPIPE
    policy: str = Field("round_robin", pattern="^(" + "|".join(POLICIES) + ")$")
    # Each replica and store node in a network namespace of its own on a bridge, the master
    # and the router on the bridge's address: partitions can be made (Network.cut). Root only.
    network_namespaces: bool = False
    masters: int = Field(1, ge=1, le=5)
    store_nodes: int = Field(1, ge=1, le=16)
    node_segment: str = "512MB"
    copies: int = Field(1, ge=1, le=16)  # Mooncake replicas of each object (kvpipe's store.replicas)
    model: Path | None = None  # a model folder (default: the tiny Llama, dummy weights)
    max_model_len: int = Field(2048, gt=0)
    kv_cache_memory_bytes: int = Field(64 << 20, gt=0)
    block_size: int = Field(128, gt=0)  # the replicas' KV block size (the router's kv_aware needs it)
    # Replicas publish KV events (vLLM's, and kvpipe's pool stream), so the router may
    # run kv_aware; on whenever the first policy is kv_aware.
    kv_events: bool = False
    connector_settings: dict[str, Any] = Field(default_factory=dict)  # kvpipe's extra config
    # Each replica's engine threads on cores of its own (this process's CPUs, shared out by
    # replica.core_shares); off: vLLM's default, every replica on every core.
    bind_cores: bool = True
    replica_args: tuple[str, ...] = ()  # more ``vllm serve`` arguments
    router_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    startup_timeout_s: float = Field(300.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _replicas_of_a_split(cls, data: Any) -> Any:
        """With ``prefill`` and ``decode`` and no ``replicas``, ``replicas`` is their sum (checked below)."""
        if (
            isinstance(data, dict)
            and data.get("replicas") is None
            and (data.get("prefill") or data.get("decode"))
        ):
            prefill, decode = data.get("prefill") or 0, data.get("decode") or 0
            if isinstance(prefill, int) and isinstance(decode, int):
                return {**data, "replicas": prefill + decode}
        return data

    @field_validator("decode")
    @classmethod
    def _a_split_has_both(cls, decode: int, info: ValidationInfo) -> int:
        prefill, replicas = info.data.get("prefill", 0), info.data.get("replicas")
        if bool(prefill) != bool(decode):
            raise PydanticCustomError(
                "split",
                "a split needs prefill and decode engines, got prefill {prefill} and decode {decode}",
                {"prefill": prefill, "decode": decode},
            )
        if decode and replicas != prefill + decode:
            raise PydanticCustomError(
                "split",
                "a split of {prefill} prefill and {decode} decode engines is {total} replicas, got {replicas}",
                {"prefill": prefill, "decode": decode, "total": prefill + decode, "replicas": replicas},
            )
        return decode

    @field_validator("connector")
    @classmethod
    def _a_split_needs_a_connector(cls, connector: Contender, info: ValidationInfo) -> Contender:
        if info.data.get("decode") and connector is Contender.NONE:
            raise PydanticCustomError(
                "split", "a prefill/decode split passes the KV cache through a connector, got none"
            )
        return connector

    @field_validator("policy")
    @classmethod
    def _kv_aware_is_for_replicas(cls, policy: str, info: ValidationInfo) -> str:
        if info.data.get("decode") and policy == "kv_aware":
            raise PydanticCustomError(
                "split", "kv_aware reads whole-request replicas' KV events, not a split's, got kv_aware"
            )
        return policy

    @property
    def roles(self) -> list[launch.KVRole]:
        """Each replica's ``kv_role``: prefill engines ``kv_both``, decode engines ``kv_consumer``."""
        first_decoder = self.replicas - self.decode
        return ["kv_both" if i < first_decoder else "kv_consumer" for i in range(self.replicas)]

    @field_validator("masters")
    @classmethod
    def _one_master_in_namespaces(cls, masters: int, info: ValidationInfo) -> int:
        if masters > 1 and info.data.get("network_namespaces"):
            raise PydanticCustomError("masters", "network namespaces run one master")
        return masters


class Fleet:
    """The processes of a :class:`FleetSpec`, started on enter and stopped on exit."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.model = spec.model or launch.model_dir("tiny-llama", launch.TINY_LLAMA)
        self.log_dir = spec.log_dir or Path(tempfile.mkdtemp(prefix="kvpipe-fleet-"))
        self.replicas: list[Served] = []
        self.router: Served | None = None
        self.policy = spec.policy  # the running router's
        self.master: LocalMaster | None = None
        self.cluster: LocalCluster | None = None
        self.store_nodes: list[StoreNodeProcess] = []
        self.kv_events = spec.kv_events or spec.policy == "kv_aware"
        # per replica: where vLLM publishes its KV events; per worker: the pool relay's stream
        self.event_ports: list[int] = []
        self.relay_ports: list[int] = []
        self.relay: PoolRelay | None = None  # with kv_aware and kvpipe's connector
        self.network: Network | None = None
        self.node_hosts: list[Host] = []  # with network namespaces: each store node's
        self.replica_hosts: list[Host] = []  # and each replica's
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
        if spec.network_namespaces:
            self.network = self._stack.enter_context(Network())  # torn down after every process
            self.replica_hosts = [self.network.add_host() for _ in range(spec.replicas)]
        self._start_store()
        if self.kv_events:
            self.event_ports = free_ports(spec.replicas)
        self.replicas = []
        bindings = self._thread_bindings()
        for i, (address, role) in enumerate(zip(self._hosts(), spec.roles, strict=True)):
            launcher = self.replica_hosts[i].launcher if self.replica_hosts else ()
            transfer, env = self._connector(address, role)
            if bindings:
                env = {**env, "VLLM_CPU_OMP_THREADS_BIND": bindings[i]}
            self.replicas.append(
                replica(
                    f"replica {i}"
                    if not spec.decode
                    else f"{'decode' if role == 'kv_consumer' else 'prefill'} {i}",
                    self.model,
                    self.log_dir / f"replica-{i}.log",
                    transfer=transfer,
                    env=env,
                    max_model_len=spec.max_model_len,
                    kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
                    extra_args=[*self._replica_args(i), *spec.replica_args],
                    host=address,
                    launcher=launcher,
                )
            )
        for served in self.replicas:  # side by side: each start is mostly waiting
            self._stack.callback(served.stop)
            served.start()
        for served in self.replicas:
            served.wait_ready(spec.startup_timeout_s)
        if self.kv_events and spec.connector is Contender.KVPIPE:
            from .pool_relay import PoolRelay  # imports vLLM (~6 s): only a fleet that relays pays it

            self.relay_ports = free_ports(spec.replicas)
            self.relay = self._stack.enter_context(
                PoolRelay(
                    [
                        f"tcp://{host}:{port}"
                        for host, port in zip(self._hosts(), self.event_ports, strict=True)
                    ],
                    [f"tcp://*:{port}" for port in self.relay_ports],
                )
            )
        self.use_policy(spec.policy)

    def use_policy(self, policy: str, router_args: tuple[str, ...] | None = None) -> None:
        """Put a new router with ``policy`` in front of the replicas (the old one stops first).

        The replicas and the store keep running, so one fleet serves several policies.
        :raises ValueError: an unknown policy. :raises ProcessError: the router did not start.
        """
        if self.router is not None:
            self.router.stop()
        args = self.spec.router_args if router_args is None else router_args
        if policy == "kv_aware":
            args = (*self._kv_aware_args(), *args)
        if self.spec.decode:
            self.router = router(
                [r.url for r in self.prefills],
                policy,
                self.log_dir,
                args,
                decoders=[r.url for r in self.decoders],
            )
        else:
            self.router = router([r.url for r in self.replicas], policy, self.log_dir, args)
        self.policy = policy
        self._stack.callback(self.router.stop)
        self.router.start()
        self.router.wait_ready(ROUTER_READY_S)

    def _thread_bindings(self) -> list[str]:
        """Each replica's ``VLLM_CPU_OMP_THREADS_BIND`` (none with ``bind_cores`` off)."""
        if not self.spec.bind_cores:
            return []
        shares = core_shares(sorted(os.sched_getaffinity(0)), self.spec.replicas)
        ranks = ranks_of(self.spec.replica_args)
        return [thread_binding(share, ranks) for share in shares]

    def _replica_args(self, index: int) -> list[str]:
        args = ["--block-size", str(self.spec.block_size)]
        if self.kv_events:
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.event_ports[index]}",
                "topic": "kv",
            }
            args += ["--kv-events-config", json.dumps(config)]
        return args

    def _kv_aware_args(self) -> list[str]:
        """The router's event sources: per replica its own stream, and its stream of the pool relay.

        The router credits a block to the worker whose stream carried it; a chunk in
        the store is reachable from every replica, so each worker also takes the
        relay's stream of every replica's pool events (:mod:`.pool_relay`).
        :raises ValueError: the replicas publish no KV events.
        """
        if not self.kv_events:
            raise ValueError(
                "policy: kv_aware needs the replicas' KV events (FleetSpec.kv_events), got them off"
            )
        args = ["--kv-event-block-size", str(self.spec.block_size), "--kv-event-model", str(self.model)]
        for i, (served, host) in enumerate(zip(self.replicas, self._hosts(), strict=True)):
            streams = [f"tcp://{host}:{self.event_ports[i]}"]
            if self.relay_ports:
                streams.append(f"tcp://{LOOPBACK}:{self.relay_ports[i]}")
            args += ["--kv-event-source", f"{served.url}=" + ",".join(streams)]
        return args

    def _start_store(self) -> None:
        spec = self.spec
        if spec.masters > 1:
            self.cluster = self._stack.enter_context(
                LocalCluster(spec.masters, store_nodes=spec.store_nodes, node_segment=spec.node_segment)
            )
            self.store_nodes = self.cluster.store_nodes
            return
        self.master = LocalMaster()
        self._stack.callback(self.master.stop)
        if self.network is None:
            self.master.start()
        else:  # on the bridge, where every namespace reaches it
            gateway = self.network.gateway
            self.master.start(MasterEndpoints(gateway, *free_ports(2, host=gateway)))
        assert self.master.endpoints is not None
        metrics = self.master_metrics
        for _ in range(spec.store_nodes):
            host = self.network.add_host() if self.network is not None else None
            node = StoreNodeProcess(
                self.master.endpoints.master_address,
                segment=spec.node_segment,
                metrics=metrics,
                local_hostname=host.address if host else LOOPBACK,
                launcher=host.launcher if host else (),
            )
            self._stack.callback(node.stop)
            self.store_nodes.append(node)
            if host is not None:
                self.node_hosts.append(host)

    def _hosts(self) -> list[str]:
        """Each replica's address (loopback, or its namespace's)."""
        return [h.address for h in self.replica_hosts] or [LOOPBACK] * self.spec.replicas

    def _connector(
        self, local_hostname: str, role: launch.KVRole
    ) -> tuple[dict[str, Any] | None, dict[str, str]]:
        """A replica's ``--kv-transfer-config`` and environment for the chosen connector and ``role``."""
        address = self.store_address
        # A load the store fails is recomputed, never a failed request (vLLM's default fails it).
        policy: launch.LoadFailurePolicy = "recompute"
        if self.spec.connector is Contender.KVPIPE:
            store = {
                **launch.store_section(address),
                "replicas": self.spec.copies,
                "local_hostname": local_hostname,
                "master_metrics": self.master_metrics,  # where each worker reads the store's capacity
            }
            # every replica that saves (a decode engine, kv_consumer, saves nothing) pins into the
            # store nodes' memory: retention's default budget is the store's capacity shared
            # among them (docs/retention.md)
            settings = {
                "store": store,
                "retention_writers": sum(r != "kv_consumer" for r in self.spec.roles),
                **self.spec.connector_settings,
            }
            return launch.kvpipe_transfer(settings, load_failure_policy=policy, kv_role=role), {}
        if self.spec.connector is Contender.VLLM:
            path = self.log_dir / "mooncake.json"
            path.write_text(json.dumps(launch.vllm_mooncake_config(address)))
            return launch.mooncake_transfer(
                load_failure_policy=policy, kv_role=role
            ), launch.vllm_mooncake_env(path)
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
    def master_metrics(self) -> list[str]:
        """``host:port`` of every master's admin HTTP (its metrics port): the store's capacity is read there."""
        masters = self.cluster.masters if self.cluster is not None else [self.master] if self.master else []
        return [f"{m.endpoints.host}:{m.endpoints.metrics_port}" for m in masters if m.endpoints is not None]

    @property
    def prefills(self) -> list[Served]:
        """The replicas that prefill (all of them without a split)."""
        return [r for r, role in zip(self.replicas, self.spec.roles, strict=True) if role != "kv_consumer"]

    @property
    def decoders(self) -> list[Served]:
        """The replicas that decode another's prefill (none without a split)."""
        return [r for r, role in zip(self.replicas, self.spec.roles, strict=True) if role == "kv_consumer"]

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
