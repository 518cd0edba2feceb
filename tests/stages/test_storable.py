"""Only prefix-cacheable groups are stored, numbered 0..k-1; bad caches are refused at build."""

from dataclasses import replace

import pytest

from kvpipe.pipeline.testing import RecordingEmit
from kvpipe.stages import (
    FullChunksStage,
    GroupKind,
    GroupSpec,
    KeyNamespace,
    ProjectedRequest,
    ProjectionError,
    project_groups,
    storable_groups,
)

from .kv_fixtures import FULL, MAMBA_ALIGN, RING, make_kv, make_request


def test_ring_buffer_is_skipped_and_mamba_is_numbered_after_the_storable_groups():
    groups = project_groups([FULL, RING, MAMBA_ALIGN])

    assert [(g.store_group, g.engine_group, g.spec.kind) for g in groups] == [
        (0, 0, GroupKind.FULL_ATTENTION),
        (1, 2, GroupKind.MAMBA),
    ]


async def test_keys_of_the_projection_never_name_the_ring_and_say_group_1_for_mamba():
    fixture = make_kv([FULL, RING, MAMBA_ALIGN])
    stage = FullChunksStage(fixture.kv)
    request = make_request(fixture.kv, tokens=16)

    await stage.process(ProjectedRequest(request, storable_groups(fixture.kv)), emit := RecordingEmit())

    (records,) = emit.emitted["out"]
    assert [r.key.split("@")[-2] for r in records] == ["group:0", "group:1"]
    assert [r.buffers for r in records] == [
        fixture.kv.shards[0].layouts[0].buffers(1),
        fixture.kv.shards[0].layouts[2].buffers(1),
    ]


def test_no_storable_group_is_an_error():
    with pytest.raises(ProjectionError, match="no storable KV-cache group"):
        project_groups([RING])


@pytest.mark.parametrize("prefix_cacheable", [True, False])
def test_mamba_outside_align_mode_is_an_error_naming_group_and_mode(prefix_cacheable):
    mamba = GroupSpec(GroupKind.MAMBA, block_size=16, prefix_cacheable=prefix_cacheable, mamba_mode="all")

    with pytest.raises(ProjectionError, match=r"engine group 1 is a mamba group in mode 'all'"):
        project_groups([FULL, mamba])


def test_block_size_must_be_a_multiple_of_the_hash_block_size():
    fixture = make_kv([FULL, GroupSpec(GroupKind.SLIDING_WINDOW, block_size=24)], hash_block_size=16)

    with pytest.raises(
        ProjectionError,
        match="engine group 1: block_size 24 is not a positive multiple of hash_block_size 16",
    ):
        storable_groups(fixture.kv)


def test_every_shard_needs_a_layout_for_every_storable_group():
    kv = make_kv([FULL, RING, MAMBA_ALIGN], shards=2).kv
    crippled = replace(kv.shards[1], layouts={0: kv.shards[1].layouts[0]})
    kv = replace(kv, shards=(kv.shards[0], crippled))

    with pytest.raises(
        ProjectionError, match=r"shard 1 .* no block layout for storable engine group\(s\) \[2\]"
    ):
        storable_groups(kv)


def test_a_group_that_is_never_stored_needs_no_layout():
    kv = make_kv([FULL, RING]).kv
    kv = replace(kv, shards=(replace(kv.shards[0], layouts={0: kv.shards[0].layouts[0]}),))

    assert [g.engine_group for g in storable_groups(kv)] == [0]


def test_shards_with_the_same_namespace_are_an_error():
    kv = make_kv(shards=2).kv
    twin = replace(kv.shards[1], namespace=kv.shards[0].namespace)

    with pytest.raises(ProjectionError, match="shards 0 and 1 have the same key namespace"):
        storable_groups(replace(kv, shards=(kv.shards[0], twin)))


def test_shards_must_share_model_and_cache_prefix():
    kv = make_kv(shards=2).kv
    other = replace(kv.shards[1], namespace=KeyNamespace(model="other-model", tp_rank=1))

    with pytest.raises(ProjectionError, match="shard 1 has model 'other-model'"):
        storable_groups(replace(kv, shards=(kv.shards[0], other)))


def test_a_cache_without_shards_is_an_error():
    with pytest.raises(ProjectionError, match="no shard"):
        storable_groups(replace(make_kv().kv, shards=()))
