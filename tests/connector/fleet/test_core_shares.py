"""How a fleet shares out this machine's cores among its replicas' engines."""

from __future__ import annotations

import pytest

from kvpipe.connector.fleet.replica import core_shares, ranks_of, thread_binding


def test_cores_are_cut_into_contiguous_shares_the_first_ones_larger() -> None:
    assert core_shares([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]


def test_each_core_goes_to_one_replica_when_they_match() -> None:
    assert core_shares([4, 5], 2) == [[4], [5]]


def test_replicas_beyond_the_cores_get_one_core_each_round_robin() -> None:
    assert core_shares([0, 1], 3) == [[0], [1], [0]]


def test_no_core_is_an_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="cores"):
        core_shares([], 2)


@pytest.mark.parametrize(
    ("args", "ranks"),
    [
        ((), 1),
        (("--tensor-parallel-size", "2"), 2),
        (("-tp=2", "--pipeline-parallel-size", "2", "--enforce-eager"), 4),
    ],
)
def test_a_replicas_ranks_are_its_tensor_times_pipeline_size(args: tuple[str, ...], ranks: int) -> None:
    assert ranks_of(args) == ranks


def test_each_rank_of_a_replica_binds_a_part_of_its_share() -> None:
    assert thread_binding([2, 3, 4, 5], 2) == "2,3|4,5"
    assert thread_binding([7], 1) == "7"
