"""Faults and looks inside for tests and benches: what no runtime module may use.

- :func:`pause` / :func:`resume`: a master stalled (SIGSTOP) and back, its state kept,
  to measure what an unresponsive master costs a client;
- :func:`durable_puts`: the keys an HA cluster's operation log holds durably, to tell a
  put lost with its leader from a loss that would be kvpipe's.

Runtime modules (the store, the vLLM connector, the command line) never import this
module: only the benches and the tests do (pyproject's import-linter contract
``harness``, which ``lint-imports`` checks).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from .cluster import LocalCluster
from .master import LOOPBACK, LocalMaster, MasterError
from .master_address import cluster_id, etcd_range

#: the operation log's op codes (Mooncake's format, schema 1)
_OPLOG_PUT, _OPLOG_REMOVE = 1, 3


def pause(master: LocalMaster) -> None:
    """SIGSTOP: the master stalls (RPCs time out) but keeps its state. Returns once stopped.

    The signal is delivered asynchronously: a call made right after ``kill()``
    returns could still be answered, so this waits for the kernel to say so.

    :raises MasterError: the master is not running, or not stopped within 5 s.
    """
    _signal_and_wait(master, signal.SIGSTOP, stopped=True)


def resume(master: LocalMaster) -> None:
    """SIGCONT: a paused master answers again. Returns once it runs.

    :raises MasterError: the master is not running, or not running again within 5 s.
    """
    _signal_and_wait(master, signal.SIGCONT, stopped=False)


def _signal_and_wait(
    master: LocalMaster, sig: signal.Signals, *, stopped: bool, timeout_s: float = 5.0
) -> None:
    pid = master.pid
    if pid is None:
        raise MasterError("this master is not running")
    os.kill(pid, sig)
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # the state is the field after the parenthesised command name: T = stopped
        state = stat.read_text().rpartition(")")[2].split()[0]
        if (state == "T") == stopped:
            return
        time.sleep(0.002)
    raise MasterError(f"mooncake_master did not {'stop' if stopped else 'continue'} within {timeout_s:g} s")


def durable_puts(cluster: LocalCluster) -> set[str]:
    """Keys whose put the leader's operation log holds durably in etcd: what a standby restores.

    The leader acknowledges a put before its log record reaches etcd (a group
    commit, a few ms later; longer on a busy machine): a put acknowledged in that
    window before the leader dies is lost with it. This reads the log
    (``/oplog/<cluster>/batches/``, records ``[schema, batch, first, last, ops,
    checksum]``, op 1 a put, 3 a remove) up to its ``durable_prefix``, to tell
    such puts from losses that would be kvpipe's. (Mooncake's own format,
    schema 1: a test and measurement aid, not an interface.)

    :raises MasterError: the cluster is not running.
    """
    if cluster.etcd_port is None:
        raise MasterError("this cluster is not running")
    prefix = f"/oplog/{cluster_id()}/".encode()
    found = dict(etcd_range(LOOPBACK, cluster.etcd_port, prefix, timeout_s=5.0) or [])
    durable = json.loads(found.get(prefix + b"durable_prefix", b'{"batch_id": 0}'))["batch_id"]
    keys: set[str] = set()
    for key, value in sorted(found.items()):
        if not key.startswith(prefix + b"batches/") or int(key.rsplit(b"/", 1)[1]) > durable:
            continue
        for op, _tenant, name, *_ in json.loads(value)[4]:
            if op == _OPLOG_PUT:
                keys.add(name)
            elif op == _OPLOG_REMOVE:
                keys.discard(name)
    return keys
