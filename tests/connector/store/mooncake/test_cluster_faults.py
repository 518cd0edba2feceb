"""What a Mooncake cluster user must be able to trust, each on real processes on loopback.

The session's cluster (etcd, two HA masters) is shared; each test adds the store
nodes it needs and stops them, and a test that kills the leader starts it again as
a standby. Clients mount no segment: the objects live in the store nodes, as in a
multi-node deployment. Figures are printed (``-s``); assertions are on counts,
bytes and the deadlines the code sets.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from kvpipe.connector.store.breaker import BreakerSettings
from kvpipe.connector.store.configs import guarded
from kvpipe.connector.store.mooncake import MooncakeSettings, MooncakeStore, harness
from kvpipe.connector.store.mooncake.cluster import LocalCluster, StoreNodeProcess
from kvpipe.connector.store.protocol import Store
from kvpipe.stages.store import Code

pytestmark = pytest.mark.mooncake

RPC_TIMEOUT_S = 1.0
#: A call that honours the client's RPC deadline (RPC_TIMEOUT_S, which the test sets) ends
#: within about a second; one that does not waits Mooncake's default deadline (30 s) or the
#: kernel's connect timeout (longer). The bound sits between the two, leaving 9 s for a busy
#: machine's scheduling: it tells a deadline kept from one ignored, never a slow machine.
STALL_BOUND_S = 10 * RPC_TIMEOUT_S
VALUE = 64 << 10
SLOTS = 64


class Values:
    """A registered buffer of ``SLOTS`` distinct 64 KiB values; key ``name-i`` holds slot ``i % SLOTS``."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.source = bytearray(b"".join(bytes([1 + slot]) * VALUE for slot in range(SLOTS)))
        self.sink = bytearray(VALUE * SLOTS)
        self._source_at = ctypes.addressof((ctypes.c_char * len(self.source)).from_buffer(self.source))
        self._sink_at = ctypes.addressof((ctypes.c_char * len(self.sink)).from_buffer(self.sink))
        assert store.register_buffer(self._source_at, len(self.source)) == 0
        assert store.register_buffer(self._sink_at, len(self.sink)) == 0

    @staticmethod
    def slot(key: str) -> int:
        return int(key.rsplit("-", 1)[1]) % SLOTS

    def put(self, keys: list[str]) -> list[int]:
        ptrs = [self._source_at + self.slot(key) * VALUE for key in keys]
        return self._store.batch_put_from(keys, ptrs, [VALUE] * len(keys), self._store.new_replicate_config())

    def read(self, keys: list[str]) -> tuple[list[str], list[str]]:
        """(keys read byte-identical, keys read with WRONG bytes); a failed read is neither."""
        good, wrong = [], []
        for start in range(0, len(keys), SLOTS):
            batch = keys[start : start + SLOTS]
            self.sink[:] = bytes(len(self.sink))
            ptrs = [self._sink_at + i * VALUE for i in range(len(batch))]
            codes = self._store.batch_get_into(batch, ptrs, [VALUE] * len(batch))
            for i, (key, code) in enumerate(zip(batch, codes, strict=True)):
                if code == VALUE:
                    same = self.sink[i * VALUE : (i + 1) * VALUE] == bytes([1 + self.slot(key)]) * VALUE
                    (good if same else wrong).append(key)
        return good, wrong

    def close(self) -> None:
        self._store.unregister_buffer(self._source_at)
        self._store.unregister_buffer(self._sink_at)


@dataclass
class OnNodes:
    """Store nodes on the cluster and a client as an engine has it: no segment, behind the breaker
    kvpipe puts every store behind."""

    nodes: list[StoreNodeProcess]
    store: Store
    values: Values


@contextmanager
def on_nodes(cluster: LocalCluster, nodes: int, **settings: object) -> Iterator[OnNodes]:
    """``nodes`` new store nodes and an engine's client; on exit the client closes and the nodes stop.

    Both ends take Mooncake's time, not kvpipe's: a client of an HA cluster closes only
    once its leader monitor's wait for a view change ends (up to 30 s, holding the GIL),
    and a store node is such a client too. They are independent, so the nodes are told to
    stop first and end while the client closes: the test waits for the longest, not the sum.
    """
    started = [cluster.add_store_node("32MB") for _ in range(nodes)]
    try:
        raw = MooncakeStore.open(
            MooncakeSettings(
                master=cluster.master_address,
                metadata_server="P2PHANDSHAKE",
                global_segment_size=0,
                local_buffer_size="16MB",
                rpc_timeout_ms=int(RPC_TIMEOUT_S * 1000),
                **settings,
            )
        )
        store = guarded(raw, BreakerSettings())
        values = Values(store)
        try:
            yield OnNodes(started, store, values)
        finally:
            values.close()
            for node in started:
                node.terminate()
            store.close()
    finally:
        for node in started:
            node.terminate()
        for node in started:
            node.stop()
            cluster.store_nodes.remove(node)


@dataclass
class Call:
    keys: list[str]
    codes: list[int]
    started: float
    seconds: float

    @property
    def stored(self) -> bool:
        return all(code == 0 for code in self.codes)


@dataclass
class SaveStream:
    """Puts batches of 4 new keys back to back on a thread, as an engine saving prefixes does."""

    values: Values
    store: Store
    prefix: str
    calls: list[Call] = field(default_factory=list)
    lookups: list[Call] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        index = 0
        while not self._stop.is_set():
            keys = [f"{self.prefix}-{index + i}" for i in range(4)]
            index += 4
            started = time.monotonic()
            codes = self.values.put(keys)
            self.calls.append(Call(keys, codes, started, time.monotonic() - started))
            started = time.monotonic()
            answers = self.store.batch_is_exist(keys)
            self.lookups.append(Call(keys, answers, started, time.monotonic() - started))
            time.sleep(0.02)

    def stored_since(self, moment: float) -> int:
        return sum(1 for call in list(self.calls) if call.started >= moment and call.stored)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def wait_until(predicate, timeout_s: float, poll_s: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def test_a_leader_failover_in_a_save_stream_fails_saves_fast_and_loses_no_durable_object(
    cluster: LocalCluster,
) -> None:
    with on_nodes(cluster, 1) as on:
        store, values = on.store, on.values
        stream = SaveStream(values, store, "failover")
        old = cluster.leader()
        assert old is not None and old.endpoints is not None
        try:
            assert wait_until(lambda: stream.stored_since(0) >= 10, timeout_s=30)
            killed = time.monotonic()
            old.kill()
            new = cluster.wait_for_leader(timeout_s=60)
            led = time.monotonic()
            assert new is not old
            assert wait_until(lambda: stream.stored_since(led) >= 5, timeout_s=60), "saves never resumed"
        finally:
            stream.stop()
            if old.pid is None:
                old.start(old.endpoints)  # back as a standby: the cluster has two masters again
        before = [key for call in stream.calls if call.stored and call.started < killed for key in call.keys]
        during = [call for call in stream.calls if killed <= call.started and not call.stored]
        resumed = next(call.started for call in stream.calls if call.started > killed and call.stored)
        durable = harness.durable_puts(cluster)
        survivors = [key for key in before if key in durable]

        # New saves and lookups failed fast during the gap: no call outlived the client's RPC
        # deadline by much (the breaker and the leader check refuse them at once); a lookup
        # answered a miss or "unknown", never a hit it could not load.
        slowest = max(call.seconds for call in stream.calls + stream.lookups)
        assert during, "no save fell in the gap"
        assert slowest < STALL_BOUND_S, f"a call stalled {slowest:.1f} s"
        assert all(
            set(lookup.codes) <= {0, 1, Code.RPC_FAILED, Code.RPC_TIMEOUT} for lookup in stream.lookups
        )
        # Every object whose put reached the operation log before the leader died is a hit and
        # loads byte-identical once the new leader serves; none loads wrong bytes.
        assert wait_until(lambda: store.batch_is_exist(survivors) == [1] * len(survivors), timeout_s=30)
        good, wrong = values.read(before)
        assert wrong == [] and set(survivors) <= set(good)
        print(
            f"\nleader killed: new leader after {led - killed:.1f} s, saves resumed after "
            f"{resumed - killed:.1f} s; {len(during)} saves failed in the gap (slowest call of all "
            f"{slowest:.2f} s); {len(before)} objects stored before, {len(survivors)} durable, all hits "
            f"after; {len(before) - len(survivors)} acknowledged in the last group commit, lost with the leader"
        )


def test_a_lost_store_node_costs_its_objects_and_no_lookup_counts_them(cluster: LocalCluster) -> None:
    keys = [f"one-node-lost-{i}" for i in range(48)]
    with on_nodes(cluster, 3) as on:
        store, values = on.store, on.values
        assert values.put(keys) == [0] * len(keys)
        on.nodes[0].kill()
        hits = [key for key, answer in zip(keys, store.batch_is_exist(keys), strict=True) if answer == 1]
        good, wrong = values.read(keys)
        # Until the master's client TTL drops the dead node it still places some puts there:
        # those fail (-800) and leave nothing behind; the others land on the survivors.
        after = [f"after-node-lost-{i}" for i in range(48)]
        codes = values.put(after)
        stored = [key for key, code in zip(after, codes, strict=True) if code == 0]
        stored_hits = [
            key for key, answer in zip(after, store.batch_is_exist(after), strict=True) if answer == 1
        ]
        good_after, wrong_after = values.read(after)
        later = [f"later-node-lost-{i}" for i in range(16)]
        assert wait_until(lambda: values.put([later.pop()]) == [0] and len(later) < 12, timeout_s=40)
    assert wrong == [] and wrong_after == []
    assert 0 < len(hits) < len(keys)  # the lost node held some, the others the rest
    assert sorted(hits) == sorted(good)  # every hit loads, and every object that loads is a hit
    assert stored and sorted(stored_hits) == sorted(stored) == sorted(good_after)
    print(
        f"\none of 3 store nodes killed: {len(keys) - len(hits)} of {len(keys)} objects lost, {len(hits)} hits, "
        f"all loading; {len(stored)} of {len(after)} new saves stored at once"
    )


def test_a_node_lost_after_lookups_learned_where_its_objects_lie_stops_counting_them_in_seconds(
    cluster: LocalCluster,
) -> None:
    """Lookups remember where objects lie; the node's liveness, probed again each second, still
    decides: within a few seconds, not the master's client TTL (10 s), its objects are misses."""
    keys = [f"placed-then-lost-{i}" for i in range(48)]
    with on_nodes(cluster, 3) as on:
        store, values = on.store, on.values
        assert values.put(keys) == [0] * len(keys)
        assert store.batch_is_exist(keys) == [1] * len(keys)  # every place learned, every node alive
        on.nodes[0].kill()
        assert wait_until(lambda: store.batch_is_exist(keys).count(1) < len(keys), timeout_s=5)
        hits = [key for key, answer in zip(keys, store.batch_is_exist(keys), strict=True) if answer == 1]
        good, wrong = values.read(keys)
    assert wrong == [] and sorted(hits) == sorted(good)  # every hit loads, and every object that loads is a hit
    print(f"\nlooked up, then one of 3 store nodes killed: {len(keys) - len(hits)} of {len(keys)} objects misses")


def test_with_two_replicas_a_lost_store_node_loses_no_object(cluster: LocalCluster) -> None:
    keys = [f"two-replicas-{i}" for i in range(48)]
    with on_nodes(cluster, 3, replicas=2) as on:
        store, values = on.store, on.values
        assert values.put(keys) == [0] * len(keys)
        on.nodes[0].kill()
        killed = time.monotonic()
        # Until the master's client TTL (10 s) drops the dead node, a read may pick its
        # replica: an object with a copy there is a miss, so no load waits on it; every hit loads.
        hits = [key for key, answer in zip(keys, store.batch_is_exist(keys), strict=True) if answer == 1]
        good, wrong = values.read(hits)
        assert sorted(good) == sorted(hits) and wrong == []
        assert len(hits) < len(keys)  # the dead node held a copy of some
        assert wait_until(lambda: store.batch_is_exist(keys) == [1] * len(keys), timeout_s=40, poll_s=0.5)
        good, wrong = values.read(keys)
        assert sorted(good) == sorted(keys) and wrong == []  # the other copy of each lives on
    print(
        f"\n2 replicas, one of 3 store nodes killed: {len(keys) - len(hits)} of {len(keys)} objects missed "
        f"until the master dropped the node; then none lost, all load {time.monotonic() - killed:.1f} s after"
    )


def test_fewer_store_nodes_than_replicas_store_fewer_copies(cluster: LocalCluster) -> None:
    with on_nodes(cluster, 1, replicas=3) as on:
        values = on.values
        keys = [f"fewer-nodes-{i}" for i in range(4)]
        assert values.put(keys) == [0] * 4
        good, wrong = values.read(keys)
    assert sorted(good) == sorted(keys) and wrong == []


def test_a_master_restarted_from_its_snapshot_keeps_the_objects_read_before_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A non-HA master with ``--enable_snapshot``: kill -9, restart on its ports, the hot cache is back.

    The client holding the segment lives on (a store node's role). On restore the master
    drops every object whose lease ran out, and only a read grants one (a put does not):
    objects read within ``default_kv_lease_ttl`` before the restart come back; objects only
    put, or put after the last snapshot, do not (printed, as Mooncake's behaviour).
    """
    from kvpipe.connector.store.mooncake.master import LocalMaster

    latest = tmp_path / "mooncake_master_snapshot" / "mooncake_cluster" / "latest.txt"

    def snapshot_id() -> str:
        return latest.read_text().strip() if latest.exists() else ""

    with LocalMaster(snapshot_dir=tmp_path, snapshot_interval_s=1, lease_ttl_ms=600_000) as master:
        assert master.endpoints is not None
        settings = MooncakeSettings(
            master=master.endpoints.master_address, metadata_server="P2PHANDSHAKE", global_segment_size="32MB"
        )
        with MooncakeStore.open(settings) as holder:
            values = Values(holder)
            read = [f"snapshot-read-{i}" for i in range(8)]
            unread = [f"snapshot-unread-{i}" for i in range(8)]
            assert values.put(read + unread) == [0] * 16
            assert sorted(values.read(read)[0]) == sorted(read)  # a read grants each a lease
            seen = [snapshot_id()]
            # the second snapshot to land after the reads started after them
            assert wait_until(lambda: seen.append(snapshot_id()) or len(set(seen) - {seen[0]}) >= 2, 30)
            late = [f"after-snapshot-{i}" for i in range(8)]
            assert values.put(late) == [0] * 8
            endpoints = master.endpoints
            master.kill()
            restarted = time.monotonic()
            master.start(endpoints)
            assert wait_until(lambda: holder.batch_is_exist(read) == [1] * 8, timeout_s=30)
            back = time.monotonic() - restarted
            good, wrong = values.read(read + unread + late)
            values.close()
    assert wrong == [] and set(read) <= set(good)
    print(
        f"\nmaster restarted from its snapshot: read objects back {back:.1f} s after (8/8); "
        f"{len(set(unread) & set(good))}/8 only put kept, {len(set(late) & set(good))}/8 put after the snapshot kept"
    )
