"""Graph wiring is validated when the graph is built, with errors naming the stage."""

import pytest

from kvpipe.pipeline import BatchPolicy, BuildError, Graph, StageSpec

from .toy_stages import AddOne, Collect, Fn, RecordBatches, Typed


def test_a_chain_builds_with_its_entry_and_topological_order():
    graph = Graph([StageSpec("b", Collect(), after=("a",)), StageSpec("a", AddOne())])
    assert graph.entry == "a"
    assert graph.order == ("a", "b")


def test_fan_out_and_fan_in_build():
    split = Fn(lambda item, emit: None, ports=("left", "right"))
    graph = Graph(
        [
            StageSpec("split", split),
            StageSpec("left", AddOne(), after=("split.left",)),
            StageSpec("right", AddOne(), after=("split.right",)),
            StageSpec("join", Collect(), after=("left", "right")),
        ]
    )
    assert [e.source for e in graph.producers("join")] == ["left", "right"]


def test_unknown_stage_in_after_is_an_error():
    with pytest.raises(BuildError, match=r"stage 'b': after 'nope': there is no stage 'nope'"):
        Graph([StageSpec("a", AddOne()), StageSpec("b", Collect(), after=("a", "nope"))])


def test_unknown_port_is_an_error_listing_the_ports():
    with pytest.raises(BuildError, match=r"stage 'a' has no port 'tail' \(ports: 'out'\)"):
        Graph([StageSpec("a", AddOne()), StageSpec("b", Collect(), after=("a.tail",))])


def test_an_unconnected_port_is_an_error():
    with pytest.raises(BuildError, match=r"stage 'a': port 'out' is not connected"):
        Graph([StageSpec("a", AddOne())])


def test_a_cycle_is_an_error():
    with pytest.raises(BuildError, match="cycle"):
        Graph(
            [
                StageSpec("entry", AddOne()),
                StageSpec("a", AddOne(), after=("entry", "b")),
                StageSpec("b", AddOne(), after=("a",)),
                StageSpec("end", Collect(), after=("b",)),
            ]
        )


def test_two_entries_are_an_error():
    with pytest.raises(BuildError, match="exactly one stage must have no 'after'"):
        Graph([StageSpec("a", Collect()), StageSpec("b", Collect())])


def test_duplicate_names_are_an_error():
    with pytest.raises(BuildError, match="stage 'a': two stages have this name"):
        Graph([StageSpec("a", AddOne()), StageSpec("a", Collect(), after=("a",))])


def test_batch_settings_on_a_stage_that_does_not_batch_are_an_error():
    with pytest.raises(BuildError, match="not a BatchStage"):
        Graph([StageSpec("a", AddOne(), batch=BatchPolicy(8)), StageSpec("b", Collect(), after=("a",))])


def test_a_batch_stage_takes_batch_settings():
    graph = Graph(
        [StageSpec("a", RecordBatches(), batch=BatchPolicy(8, 0.01)), StageSpec("b", Collect(), after=("a",))]
    )
    assert graph.spec("a").batch_policy.max_items == 8


def test_declared_types_that_do_not_fit_are_an_error():
    with pytest.raises(BuildError, match="stage 'second': accepts int but first.out emits str"):
        Graph(
            [
                StageSpec("first", Typed()),
                StageSpec("second", Typed(), after=("first",)),
                StageSpec("end", Collect(), after=("second",)),
            ]
        )


@pytest.mark.parametrize("field, value", [("workers", 0), ("capacity", -1)])
def test_non_positive_sizes_are_an_error(field, value):
    with pytest.raises(BuildError, match=rf"{field}: must be > 0, got {value}"):
        Graph([StageSpec("a", AddOne(), **{field: value}), StageSpec("b", Collect(), after=("a",))])
