"""``project`` routes a request to the full path, the tail path, both, or drops it."""

from dataclasses import replace

import pytest

from kvpipe.pipeline.testing import RecordingEmit
from kvpipe.stages import GroupKind, GroupSpec, ProjectedRequest, ProjectionError, ProjectStage

from .kv_fixtures import FULL, MAMBA_ALIGN, RING, make_kv, make_request

BIG = GroupSpec(GroupKind.FULL_ATTENTION, block_size=32)


async def _project(kv, request):
    await ProjectStage(kv).process(request, emit := RecordingEmit())
    return emit


async def test_new_complete_chunks_go_to_full_with_the_storable_groups():
    kv = make_kv([FULL, RING, MAMBA_ALIGN]).kv
    request = make_request(kv, tokens=20)

    emit = await _project(kv, request)

    (projected,) = emit.emitted["full"]
    assert isinstance(projected, ProjectedRequest)
    assert projected.request is request
    assert [g.engine_group for g in projected.groups] == [0, 2]
    assert emit.emitted["tail"] == []


async def test_a_finished_request_with_a_partial_tail_goes_to_tail_too():
    kv = make_kv([BIG], hash_block_size=16).kv

    emit = await _project(kv, make_request(kv, tokens=32 + 16, finished=True))

    assert len(emit.emitted["full"]) == 1
    assert len(emit.emitted["tail"]) == 1


async def test_a_finished_request_with_only_a_tail_goes_to_tail_only():
    kv = make_kv([BIG], hash_block_size=16).kv

    emit = await _project(kv, make_request(kv, tokens=32 + 16, saved=32, finished=True))

    assert emit.emitted["full"] == []
    assert len(emit.emitted["tail"]) == 1


async def test_a_request_with_nothing_new_is_dropped():
    kv = make_kv().kv

    emit = await _project(kv, make_request(kv, tokens=40, saved=32))

    assert emit.dropped == ["nothing to save"]
    assert not emit.emitted


async def test_a_request_without_block_ids_for_every_engine_group_is_an_error():
    kv = make_kv([FULL, RING]).kv
    request = replace(make_request(kv, tokens=16), block_ids=((1,),))

    with pytest.raises(ValueError, match="block ids for 1 engine groups, the KV cache has 2"):
        await _project(kv, request)


def test_a_cache_that_cannot_be_saved_is_refused_when_the_stage_is_built():
    with pytest.raises(ProjectionError):
        ProjectStage(make_kv([RING]).kv)
