"""The save graph under a matrix of store faults: jobs end, counts add up, bytes survive.

Hypothesis draws a store that misbehaves (per-operation error codes with their
probabilities, small latencies, outages switched on and off in the middle of a
run), a cache shape (1-2 TP shards, maybe a hybrid of full attention, a ring
buffer and an aligned mamba group, maybe partial tails), group semantics on or
off (and a store with or without group ids), gathering into staging or not, the
put stage's slow-store throttle (default, scaled to shed under these latencies, or off), a
store small enough to evict or not, the bridge's wait or drop policy, and a
chat-like workload of 250 save requests whose prefixes are shared between
requests; a few keys are first stored by a "foreign writer" with the wrong
size. Forty examples make 10,000 requests. The requests go through the default
save graph behind the sync bridge into a :class:`MemoryStore`; afterwards:

- every job ended (and was released), was handed back once, and the bridge's
  outcome tally covers every submit; no staging slot is left held;
- per job, ``considered = existing + put + failed + throttled``, its failed and succeeded
  units are exactly those records (no stage raised), and its outcome follows;
- no object was ever stored under a group id other than the one its own key's
  chunk hash gives (checked on every put call and on what the store holds);
- every object the store holds is read back byte-identical to the engine block
  it was saved from, unless its size differs (a foreign writer stored the key
  first), in which case the read into the block's size fails;
- the load path (``default_load_graph``), with the get faults still on, loads
  each chain into fresh blocks: a block it does not report as failed holds
  exactly the saved bytes, and a key stored with the wrong size is always a
  failed block, never loaded bytes.

The examples come from a fixed seed and no database, so CI runs the same forty
(about 5 s).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio
import structlog
import xxhash
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from kvpipe.connector.store.memory import Faults, MemoryStore
from kvpipe.pipeline import Job, Outcome, Pipeline, SyncPipeline
from kvpipe.stages import (
    LoadRequest,
    ObjectStatus,
    SaveRequest,
    StoreObject,
    ThrottleParams,
    default_load_graph,
    default_save_graph,
    group_id,
    object_key,
)
from kvpipe.stages.integrity import SEAL_SIZE, Seal, is_seal_key, key_id, seal_key, sealed_key

from .kv_fixtures import FULL, RING, KVFixture, make_kv

REQUESTS_PER_EXAMPLE = 250  # x 40 examples: 10,000 requests
CODES = (-200, -600, -704, -706, -800, -900, -901)
BLOCK = 16  # tokens per block, every group
SYSTEM_PROMPTS = 3
SYSTEM_CHUNKS = 2  # chunks every chain of a system prompt shares
CHAINS = 16
OWN_CHUNKS = 5  # chunks of a chain after its system prompt
CHAIN_CHUNKS = SYSTEM_CHUNKS + OWN_CHUNKS
NUM_BLOCKS = 1 + SYSTEM_PROMPTS * SYSTEM_CHUNKS + CHAINS * OWN_CHUNKS  # block 0 is the null block
LOAD_BLOCKS = 1 + CHAINS * CHAIN_CHUNKS
POISONED = 4  # keys a foreign writer stores first, with the wrong size


# -- the store --------------------------------------------------------------------------


class CheckedStore(MemoryStore):
    """A MemoryStore that checks each put call's group ids against its keys and logs removals.

    The check runs at put time, so an object that is evicted before the end of
    the run was still checked.
    """

    def __init__(self, *args, expected_group, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.expected_group = expected_group  # key -> the group id its chunk hash gives, or None
        self.wrong_groups: list[tuple[str, str | None]] = []
        self.dropped_keys: set[str] = set()

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes, config):
        group_ids = getattr(config, "group_ids", None)
        for i, key in enumerate(keys):
            given_group = (group_ids[i] or None) if group_ids else None
            if given_group != self.expected_group(key):
                self.wrong_groups.append((key, given_group))
        return super().batch_put_from_multi_buffers(keys, ptrs, sizes, config)

    def _drop(self, key: str) -> int:  # evicted or removed
        self.dropped_keys.add(key)
        return super()._drop(key)

    def held(self) -> dict[str, tuple[int, str | None]]:
        """key -> (size, group id) of every object stored now."""
        with self._lock:
            return {key: (len(obj.data), obj.group) for key, obj in self._objects.items()}


def read_seal(store: MemoryStore, key: str) -> Seal | None:
    destination = bytearray(SEAL_SIZE)
    address = ctypes.addressof((ctypes.c_char * SEAL_SIZE).from_buffer(destination))
    (result,) = store.batch_get_into_multi_buffers([seal_key(key)], [[address]], [[SEAL_SIZE]])
    return Seal.unpack(bytes(destination)) if result == SEAL_SIZE else None


# -- the workload ------------------------------------------------------------------------


def _hashes(salt: str, count: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"{salt}:{i}".encode()).digest() for i in range(count))


@dataclass
class Chain:
    """A conversation: a shared system prompt, then its own chunks, each on a fixed block.

    Equal chunk hashes always sit on the same blocks, so a key has one true value
    however many requests save it.
    """

    hashes: tuple[bytes, ...]  # one per hash block, CHAIN_CHUNKS * BLOCK tokens
    blocks: tuple[int, ...]  # one per chunk
    computed: int = 0  # tokens the engine computed so far


def make_chains(hash_block: int) -> list[Chain]:
    per_chunk = BLOCK // hash_block
    system = [
        (
            _hashes(f"sys{s}", SYSTEM_CHUNKS * per_chunk),
            tuple(range(1 + s * SYSTEM_CHUNKS, 1 + (s + 1) * SYSTEM_CHUNKS)),
        )
        for s in range(SYSTEM_PROMPTS)
    ]
    first_own = 1 + SYSTEM_PROMPTS * SYSTEM_CHUNKS
    chains = []
    for c in range(CHAINS):
        sys_hashes, sys_blocks = system[c % SYSTEM_PROMPTS]
        own = tuple(range(first_own + c * OWN_CHUNKS, first_own + (c + 1) * OWN_CHUNKS))
        chains.append(Chain(sys_hashes + _hashes(f"chain{c}", OWN_CHUNKS * per_chunk), sys_blocks + own))
    return chains


def next_request(
    chains: list[Chain], rng: random.Random, groups: int, hash_block: int, index: int
) -> SaveRequest:
    """One engine step of a random chain: it computes more tokens, maybe finishes, maybe restarts."""
    chain = rng.choice(chains)
    limit = CHAIN_CHUNKS * BLOCK
    if chain.computed >= limit or rng.random() < 0.1:
        chain.computed = 0  # a new turn re-saves from the start: mostly existing objects
    saved = chain.computed if rng.random() < 0.8 else 0
    chain.computed = min(limit, chain.computed + rng.choice((5, 8, 16, 24, 40, 64)))
    finished = rng.random() < 0.3 or chain.computed == limit
    hashed = chain.computed // hash_block
    blocks = chain.blocks[: -(-chain.computed // BLOCK)]
    return SaveRequest(
        request_id=f"req-{index}",
        block_hashes=chain.hashes[:hashed],
        block_ids=tuple(blocks for _ in range(groups)),
        num_computed_tokens=chain.computed,
        num_saved_tokens=min(saved, chain.computed),
        finished=finished,
    )


# -- the strategies ----------------------------------------------------------------------


def error_rates(max_each: float):
    return st.dictionaries(st.sampled_from(CODES), st.sampled_from((0.01, 0.03, 0.1, max_each)), max_size=3)


@st.composite
def fault_plans(draw):
    """Faults for the run, and (request index, faults) switches made while submitting."""
    rates = {op: draw(error_rates(0.2)) for op in ("exist", "put", "get")}
    if draw(st.booleans()):
        rates["put"].pop(-200, None)  # -200 backs off the put stage: not in every example
    latency = {op: draw(st.sampled_from((0.0, 0.0, 0.0005, 0.002))) for op in ("exist", "put", "get")}
    seed = draw(st.integers(0, 2**16))
    base = Faults(error_rates={op: r for op, r in rates.items() if r}, latency_s=latency, seed=seed)
    switches = []
    for _ in range(draw(st.integers(0, 2))):
        start = draw(st.integers(0, REQUESTS_PER_EXAMPLE - 1))
        length = draw(st.integers(1, REQUESTS_PER_EXAMPLE // 3))
        outage = draw(st.sampled_from(("down", "stalled")))
        stall = draw(st.sampled_from((0.0, 0.002)))
        switches.append((start, Faults(outage=outage, stall_s=stall)))
        switches.append((min(REQUESTS_PER_EXAMPLE, start + length), base))
    switches.sort(key=lambda switch: switch[0])
    return base, switches


@dataclass
class Scenario:
    groups: tuple
    shards: int
    hash_block: int
    group_semantics: bool
    store_has_group_ids: bool
    small_store: bool
    when_full: str
    queue_capacity: int
    gather: str
    throttle: ThrottleParams | None
    seed: int


# Scaled to the drawn latencies (0-2 ms), so that slow puts start and end shedding.
QUICK_THROTTLE = ThrottleParams(slow_s=0.001, recovered_s=0.0003, ema_weight=0.5, probe_every_s=0.005)

scenarios = st.builds(
    Scenario,
    # two stored groups around one that is not (a mamba group's sparse states have tests of their own)
    groups=st.sampled_from(((FULL,), (FULL, RING, FULL))),
    shards=st.integers(1, 2),
    hash_block=st.sampled_from((8, 16)),
    group_semantics=st.booleans(),
    store_has_group_ids=st.booleans(),
    small_store=st.booleans(),
    when_full=st.sampled_from(("wait", "wait", "drop")),
    queue_capacity=st.sampled_from((8, 64, 1024)),
    gather=st.sampled_from(("auto", "always")),  # auto never gathers for a local store
    throttle=st.sampled_from((QUICK_THROTTLE, ThrottleParams(), QUICK_THROTTLE, None)),
    seed=st.integers(0, 2**16),
)


# -- the run -----------------------------------------------------------------------------


@dataclass
class Seen:
    """What the observer learnt: each key's source records and the statuses reported."""

    sources: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = field(default_factory=dict)
    statuses: Counter[ObjectStatus] = field(default_factory=Counter)
    put_keys: set[str] = field(default_factory=set)
    records: dict[str, StoreObject] = field(default_factory=dict)

    def __call__(self, record: StoreObject, status: ObjectStatus) -> None:
        ptrs = tuple(buffer.address for buffer in record.buffers)
        sizes = tuple(buffer.size for buffer in record.buffers)
        self.sources.setdefault(record.key, set()).add((ptrs, sizes))
        self.records.setdefault(record.key, record)
        self.statuses[status] += 1
        if status is ObjectStatus.PUT:
            self.put_keys.add(record.key)


def source_bytes(record: StoreObject) -> bytes:
    """The object a record stands for: its engine buffers' bytes, concatenated (never written)."""
    return b"".join(ctypes.string_at(buffer.address, buffer.size) for buffer in record.buffers)


def expected_group_fn(fixture: KVFixture, grouped: bool):
    namespace = fixture.kv.shards[0].namespace

    def expected(key: str) -> str | None:
        """A seal's group is its object's."""
        key = sealed_key(key) if is_seal_key(key) else key
        return group_id(namespace, bytes.fromhex(key.rsplit("@", 1)[1])) if grouped else None

    return expected


def poison(store: CheckedStore, fixture: KVFixture, chains: list[Chain], grouped: bool) -> dict[str, int]:
    """Store a few of the workload's keys first with the wrong size; key -> that size."""
    namespace = fixture.kv.shards[0].namespace
    per_chunk = BLOCK // fixture.kv.hash_block_size
    size = fixture.kv.shards[0].layouts[0].object_size
    poisoned = {}
    for i in range(POISONED):
        chain = chains[i * 3 % len(chains)]
        chunk = SYSTEM_CHUNKS + i % OWN_CHUNKS
        chunk_hash = chain.hashes[(chunk + 1) * per_chunk - 1]
        key = object_key(namespace, 0, chunk_hash)
        wrong = bytearray(size // 2 if i % 2 else size + 64)
        config = store.new_replicate_config()
        if grouped:
            config.group_ids = [group_id(namespace, chunk_hash)]
        address = ctypes.addressof((ctypes.c_char * len(wrong)).from_buffer(wrong))
        assert store.batch_put_from_multi_buffers([key], [[address]], [[len(wrong)]], config) == [0]
        poisoned[key] = len(wrong)
    return poisoned


def check_job(job: Job) -> None:
    assert job.done and job.released, job
    counts = job.counts
    if job.outcome is Outcome.DROPPED:
        assert counts["considered"] == 0
        return
    settled = counts["existing"] + counts["put"] + counts["failed"] + counts["throttled"]
    assert counts["considered"] == settled, f"{job}: considered != existing + put + failed + throttled"
    assert job.failed_units == counts["failed"], f"{job}: failures beside the records' ({job.first_error})"
    assert job.succeeded_units == counts["existing"] + counts["put"], job
    if counts["failed"] == 0:  # throttled records are deliberate drops, not failures
        assert job.outcome is Outcome.OK, job
    elif counts["existing"] + counts["put"]:
        assert job.outcome is Outcome.PARTIAL, job
    else:  # nothing stored: failed, or partial when the filter dropped the emptied entry
        assert job.outcome in (Outcome.FAILED, Outcome.PARTIAL), job
    if counts["backpressure"]:
        assert counts["failed"] >= counts["backpressure"], job


def save_all(scenario: Scenario, faults: Faults, switches, fixture, store, chains, seen) -> list[Job]:
    rng = random.Random(scenario.seed)
    graph = default_save_graph(
        fixture.kv,
        store,
        enable_group_semantics=scenario.group_semantics,
        gather=scenario.gather,
        throttle=scenario.throttle,
        observer=seen,
    )
    jobs: list[Job] = []
    pending = list(switches)
    with SyncPipeline(graph, queue_capacity=scenario.queue_capacity, when_full=scenario.when_full) as bridge:
        for index in range(REQUESTS_PER_EXAMPLE):
            while pending and pending[0][0] <= index:
                store.faults = pending.pop(0)[1]
            jobs.append(
                bridge.submit(next_request(chains, rng, len(scenario.groups), scenario.hash_block, index))
            )
            if scenario.when_full == "drop" and index % 16 == 15:
                time.sleep(0.001)  # an engine step; a submitter that never pauses has nearly all refused
        store.faults = faults  # an outage ends before the drain
    handed_back = bridge.completed()
    assert sorted(job.id for job in handed_back) == sorted(job.id for job in jobs), (
        "a job was never handed back"
    )
    (pool,) = [spec.stage.pool for spec in graph.specs if spec.name == "gather"]
    if pool is not None and pool.allocated:
        assert pool.free == pool.slots, f"{pool.slots - pool.free} staging slots never released"
    outcomes = Counter(str(job.outcome) for job in jobs)
    assert bridge.outcomes() == dict(outcomes)
    assert bridge.submitted + bridge.dropped == len(jobs)
    return jobs


async def load_all(
    fixture: KVFixture, target: KVFixture, store, chains: list[Chain], groups: int, stored: int
):
    """Load every chain's whole range into fresh blocks of ``target``; request id -> failed blocks."""
    failed: dict[str, frozenset[int]] = {}
    requests = []
    for c, chain in enumerate(chains):
        blocks = tuple(range(1 + c * CHAIN_CHUNKS, 1 + (c + 1) * CHAIN_CHUNKS))
        requests.append(
            LoadRequest(
                f"load-{c}", chain.hashes, tuple(blocks for _ in range(groups)), 0, CHAIN_CHUNKS * BLOCK
            )
        )
    graph = default_load_graph(target.kv, store, lambda request, ids: failed.setdefault(request.request_id, ids))
    async with Pipeline(graph) as pipeline:
        jobs = [await pipeline.submit(request) for request in requests]
    for job in jobs:
        assert job.done
        assert job.counts["loaded"] + job.counts["failed"] == CHAIN_CHUNKS * stored * len(fixture.kv.shards)
        assert job.failed_units == job.counts["failed"]
    return requests, failed


@settings(
    max_examples=40,
    derandomize=False,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@seed(20261130)
@given(scenario=scenarios, plan=fault_plans())
def test_fault_matrix_jobs_end_counts_add_up_and_bytes_survive(scenario: Scenario, plan):
    # Thousands of refused objects each log a debug line; the warnings are what matter.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    faults, switches = plan
    fixture = make_kv(
        scenario.groups, shards=scenario.shards, num_blocks=NUM_BLOCKS, hash_block_size=scenario.hash_block
    )
    chains = make_chains(scenario.hash_block)
    grouped = scenario.group_semantics and scenario.store_has_group_ids
    expected_group = expected_group_fn(fixture, grouped)
    capacity = (
        (NUM_BLOCKS // 2 if scenario.small_store else 4 * NUM_BLOCKS)
        * 1024
        * scenario.shards
        * len(scenario.groups)
    )
    store = CheckedStore(
        capacity,
        group_ids_supported=scenario.store_has_group_ids,
        lease_ttl_s=0.0,
        expected_group=expected_group,
    )
    poisoned = poison(store, fixture, chains, grouped)
    store.faults = faults
    seen = Seen()

    jobs = save_all(scenario, faults, switches, fixture, store, chains, seen)

    # Every job ended, and its counts add up.
    for job in jobs:
        check_job(job)
    totals = Counter()
    for job in jobs:
        totals.update(job.counts)
    assert totals["considered"] == sum(seen.statuses.values())
    assert {status.value: n for status, n in seen.statuses.items()} == {
        name: totals[name] for name in ("existing", "put", "failed", "throttled") if totals[name]
    }

    # No object under another object's group id, at put time or now.
    assert store.wrong_groups == []
    held = store.held()
    seals = {sealed_key(key): value for key, value in held.items() if is_seal_key(key)}
    held = {key: value for key, value in held.items() if not is_seal_key(key)}
    for key, (_, group) in [*held.items(), *seals.items()]:
        assert group == expected_group(key), key

    # One true value per key, and what was reported stored is there unless evicted.
    assert all(len(sources) == 1 for sources in seen.sources.values())
    assert set(held) <= set(seen.records) | set(poisoned)
    assert not {key for key in seen.put_keys if key not in held and key not in store.dropped_keys}

    # Read every held object back: byte-identical, or (wrong size) a failed read.
    store.faults = Faults()
    for key, (size, _) in held.items():
        record = seen.records.get(key)
        if record is None:  # poisoned and never considered: nothing to compare against
            continue
        want = source_bytes(record)
        destination = bytearray(len(want))
        address = ctypes.addressof((ctypes.c_char * len(destination)).from_buffer(destination))
        (result,) = store.batch_get_into_multi_buffers([key], [[address]], [[len(destination)]])
        if size == len(want):
            assert result == size and bytes(destination) == want, key
        else:
            assert key in poisoned, f"{key}: stored {size} bytes, saved {len(want)}"
            assert result < 0, f"{key}: a read of the wrong size returned {result}"

    # A seal only ever vouches for saved objects' true bytes, and only sits under a saved key.
    assert set(seals) <= set(seen.records)
    by_id = {key_id(key): key for key in seen.records}
    for anchor in seals:
        seal = read_seal(store, anchor)
        assert seal is not None and seal.entries, anchor
        for entry in seal.entries:
            want = source_bytes(seen.records[by_id[entry.key_id]])
            assert (entry.size, entry.checksum) == (len(want), xxhash.xxh3_64_intdigest(want)), anchor

    # The load path, get faults back on: a block is either reported failed or exact.
    store.faults = faults
    target = make_kv(
        scenario.groups,
        shards=scenario.shards,
        num_blocks=LOAD_BLOCKS,
        hash_block_size=scenario.hash_block,
        seed=1,
    )
    stored_groups = [g for g, spec in enumerate(scenario.groups) if spec.prefix_cacheable]
    requests, failed = anyio.run(
        load_all, fixture, target, store, chains, len(scenario.groups), len(stored_groups)
    )
    for c, (chain, request) in enumerate(zip(chains, requests, strict=True)):
        failed_blocks = failed[request.request_id]
        for chunk in range(CHAIN_CHUNKS):
            block = request.block_ids[0][chunk]
            chunk_hash = chain.hashes[(chunk + 1) * (BLOCK // scenario.hash_block) - 1]
            key = object_key(fixture.kv.shards[0].namespace, 0, chunk_hash)
            if key in poisoned and held.get(key, (None,))[0] == poisoned[key]:
                assert block in failed_blocks, f"chain {c} chunk {chunk}: a wrong-size object loaded"
            if block in failed_blocks:
                continue
            for shard in range(scenario.shards):
                for g in stored_groups:
                    assert target.block_bytes(shard, g, block) == fixture.block_bytes(
                        shard, g, chain.blocks[chunk]
                    ), f"chain {c} chunk {chunk} shard {shard} group {g}: loaded bytes differ"


def test_a_destination_of_the_wrong_size_is_a_failed_load_never_loaded_bytes():
    """Objects saved from a 2-layer cache, loaded into a 3-layer one: every block fails, none is written."""
    source = make_kv((FULL,), shards=2, num_blocks=NUM_BLOCKS, hash_block_size=BLOCK)
    store = MemoryStore(lease_ttl_s=0.0)
    chain = make_chains(BLOCK)[0]
    request = SaveRequest("save", chain.hashes, (chain.blocks,), CHAIN_CHUNKS * BLOCK, finished=True)
    with SyncPipeline(default_save_graph(source.kv, store)) as bridge:
        saved = bridge.submit(request)
    assert saved.outcome is Outcome.OK and saved.counts["put"] == CHAIN_CHUNKS * 2

    target = make_kv((FULL,), shards=2, layers=3, num_blocks=LOAD_BLOCKS, hash_block_size=BLOCK, seed=1)
    before = {
        (shard, block): target.block_bytes(shard, 0, block) for shard in range(2) for block in chain.blocks
    }
    failed: dict[str, frozenset[int]] = {}

    async def load() -> Job:
        graph = default_load_graph(target.kv, store, lambda request, ids: failed.setdefault(request.request_id, ids))
        async with Pipeline(graph) as pipeline:
            job = await pipeline.submit(
                LoadRequest("load", chain.hashes, (chain.blocks,), 0, CHAIN_CHUNKS * BLOCK)
            )
        return job

    job = anyio.run(load)
    assert job.outcome is Outcome.FAILED
    assert (job.counts["loaded"], job.counts["failed"]) == (0, CHAIN_CHUNKS * 2)
    assert failed["load"] == frozenset(chain.blocks)
    assert before == {(s, b): target.block_bytes(s, 0, b) for s, b in before}, (
        "a refused read wrote the block"
    )
