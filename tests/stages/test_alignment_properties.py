"""Properties of the save path under any mix of store answers.

Whatever the cache shape, the requests, the store's per-key answers and the
buffer budget: every put call's parallel lists describe one record per
position, every record collected ends exactly one way (existing, put or
failed) as the store's answers say, and nothing the store reported as present
or could not vouch for is put.
"""

from collections import Counter

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.stages import GroupKind, GroupSpec, StoreObject, is_seal_key
from kvpipe.stages.integrity import SEAL_SIZE
from kvpipe.stages.keys import sealed_key

from .kv_fixtures import make_kv, make_request
from .save_path import put_params, run_save_path
from .stores import RecordingStore, ScriptedStore, by_first_sight

HASH_BLOCK = 4
EXIST_CODES = [0, 0, 1, -1, -900, -901]  # absent twice as likely, so many records reach put
PUT_CODES = [0, -705, -200, -800, -600, -900]


@st.composite
def group_specs(draw):
    kind = draw(st.sampled_from(["full", "window", "ring", "mamba"]))
    block_size = HASH_BLOCK * draw(st.integers(1, 3))
    if kind == "ring":
        return GroupSpec(GroupKind.RING_BUFFER, block_size, prefix_cacheable=False)
    if kind == "mamba":
        return GroupSpec(GroupKind.MAMBA, block_size, mamba_mode="align")
    return GroupSpec(GroupKind.FULL_ATTENTION if kind == "full" else GroupKind.SLIDING_WINDOW, block_size)


@st.composite
def scenarios(draw):
    groups = draw(
        st.lists(group_specs(), min_size=1, max_size=3).filter(lambda gs: any(g.prefix_cacheable for g in gs))
    )
    fixture = make_kv(
        groups, shards=draw(st.integers(1, 3)), layers=draw(st.integers(1, 3)), hash_block_size=HASH_BLOCK
    )
    requests = []
    for index in range(draw(st.integers(1, 4))):
        tokens = draw(st.integers(HASH_BLOCK, 8 * HASH_BLOCK))
        requests.append(
            make_request(
                fixture.kv,
                tokens,
                saved=draw(st.one_of(st.just(0), st.integers(0, tokens))),
                finished=draw(st.booleans()),
                request_id=f"req-{index}",
                first_block=1 + index,
            )
        )
    return fixture, requests


def _outcome(key, buffers, exist, put, budget):
    """What should become of a record, from the store's scripted answers alone (``buffers``: its seal's too)."""
    if exist(key) == 1:
        return "existing"
    if exist(key) != 0 or buffers > budget:
        return "failed"
    return {0: "put", -705: "existing"}.get(put(key), "failed")


def _torn(put_calls, put) -> set[str]:
    """Keys stored in a call where another object of their chunk (group id) was refused (seals aside)."""
    torn: set[str] = set()
    for call in put_calls:
        if call.group_ids is None:
            continue
        objects = [(key, gid) for key, gid in zip(call.keys, call.group_ids, strict=True) if not is_seal_key(key)]
        refused = {gid for key, gid in objects if gid and put(key) not in (0, -705)}
        torn |= {key for key, gid in objects if put(key) == 0 and gid in refused}
    return torn


def _chunk_hex(name: str) -> str:
    return name.rsplit("@", 1)[1]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenario=scenarios(),
    exist_script=st.lists(st.sampled_from(EXIST_CODES), min_size=1, max_size=6),
    put_script=st.lists(st.sampled_from(PUT_CODES), min_size=1, max_size=6),
    budget=st.integers(1, 8),
    group_semantics=st.booleans(),
    store_has_group_ids=st.booleans(),
    sealed=st.booleans(),
)
def test_put_calls_stay_aligned_and_every_record_ends_once(
    scenario, exist_script, put_script, budget, group_semantics, store_has_group_ids, sealed
):
    fixture, requests = scenario
    exist, put = by_first_sight(exist_script), by_first_sight(put_script)
    store = RecordingStore(ScriptedStore(exist, put, supports_group_ids=store_has_group_ids))
    # no space wait: a refusal for space is scripted to last, and waiting it out adds nothing but time
    params = put_params(max_buffers_per_call=budget, backoff_initial_s=0, backoff_max_s=0, space_wait_s=0)

    async def save():
        return await run_save_path(
            fixture.kv, store, requests, group_semantics=group_semantics, put=params, sealed=sealed
        )

    run = anyio.run(save)

    by_key: dict[str, StoreObject] = {r.key: r for r in run.records}
    assert len(by_key) == len(run.records), "two records share a key"
    for call in store.put_calls:
        assert len(call.ptrs) == len(call.sizes) == len(call.keys) == len(set(call.keys))
        assert sum(len(ptrs) for ptrs in call.ptrs) <= budget
        assert call.group_ids is None or len(call.group_ids) == len(call.keys)
        if sealed:  # each seal after its anchor (an object of the call), one buffer, in its anchor's group
            seals = [i for i, key in enumerate(call.keys) if is_seal_key(key)]
            assert 0 < len(seals) <= len(call.keys) - len(seals)
            for i in seals:
                anchor = call.keys.index(sealed_key(call.keys[i]))
                assert anchor < i and call.sizes[i] == [SEAL_SIZE]
                assert call.group_ids is None or call.group_ids[i] == call.group_ids[anchor]
        for i, key in enumerate(call.keys):
            if is_seal_key(key):
                continue
            record = by_key[key]
            assert call.ptrs[i] == [b.address for b in record.buffers]
            assert call.sizes[i] == [b.size for b in record.buffers]
            if call.group_ids is not None:
                assert call.group_ids[i] == record.group_id
                assert _chunk_hex(call.group_ids[i]) == _chunk_hex(key) == record.chunk_hash.hex()

    put_keys = [key for key in store.put_keys if not is_seal_key(key)]
    assert not {key for key in put_keys if exist(key) != 0}, "put a key the store had or could not vouch for"
    torn = _torn(store.put_calls, put)
    assert sorted(store.inner.removed) == sorted(torn), "removed exactly the stored objects of torn chunks"
    for request in requests:
        expected = Counter(
            "failed" if r.key in torn else _outcome(r.key, len(r.buffers) + sealed, exist, put, budget)
            for r in run.records
            if r.request_id == request.request_id
        )
        counts = run.counts_by_request.get(request.request_id, Counter())
        assert counts["considered"] == expected.total()
        assert {name: counts[name] for name in ("existing", "put", "failed")} == {
            name: expected[name] for name in ("existing", "put", "failed")
        }
