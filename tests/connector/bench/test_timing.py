"""Side-by-side timing: what ``alternate`` reports for each contender."""

from kvpipe.connector.timing import Timed, alternate


def test_each_contender_gets_its_median_round_and_the_median_of_its_rounds_cores():
    rounds = {
        # the first of each is the untimed round
        "timed": iter([Timed(9.0, 9.0), Timed(1.0, 0.5), Timed(2.0, 2.0), Timed(4.0, 1.0)]),
        "bare": iter([9.0, 3.0, 1.0, 2.0]),
    }
    medians, cores = alternate({name: lambda values=values: next(values) for name, values in rounds.items()}, 3)
    assert medians == {"timed": 2.0, "bare": 2.0}
    assert cores == {"timed": 0.5}  # its rounds kept 0.5, 1.0 and 0.25 cores busy; bare seconds say nothing of CPU


def test_cores_are_cpu_over_wall_and_nothing_for_an_empty_span():
    assert Timed(2.0, 3.0).cores == 1.5
    assert Timed(0.0, 0.0).cores == 0.0
