"""Retention's default pin budget per worker (:meth:`.ConnectorSettings.max_pinned_bytes`), without a store.

The rule: ``retention_max_pinned`` if given; else 0.9 of the store's capacity shared
among the workers that pin (``retention_writers`` engines x the engine's ranks that
put), except where the worker lends memory and no writer count is given, or the
capacity is unknown: then 0.9 of what the worker lends.
"""

from __future__ import annotations

import pytest

from kvpipe.connector.vllm.settings import settings_from
from kvpipe.stages.errors import ConfigError
from kvpipe.stages.retention import PinnedBudget


def _capacity_not_read() -> int | None:
    raise AssertionError("the store's capacity was read where the rule does not need it")


def test_an_engine_lending_nothing_pins_most_of_the_store_capacity() -> None:
    budget = settings_from(None).max_pinned_bytes(0, store_capacity=lambda: 1000)

    assert budget == PinnedBudget(900, "store capacity", store_capacity=1000, writers=1)


def test_the_store_capacity_is_shared_among_the_engine_ranks_that_put() -> None:
    budget = settings_from(None).max_pinned_bytes(0, putting_ranks=4, store_capacity=lambda: 1000)

    assert (budget.pinned_bytes, budget.writers) == (225, 4)


def test_retention_writers_share_the_store_capacity_among_engines() -> None:
    settings = settings_from({"retention_writers": 3})

    budget = settings.max_pinned_bytes(0, putting_ranks=2, store_capacity=lambda: 6000)

    assert (budget.pinned_bytes, budget.writers) == (900, 6)


def test_an_engine_lending_memory_without_a_writer_count_pins_in_what_it_lends() -> None:
    budget = settings_from(None).max_pinned_bytes(1000, putting_ranks=2, store_capacity=_capacity_not_read)

    assert budget == PinnedBudget(900, "lent")


def test_with_a_writer_count_an_engine_lending_memory_shares_the_store_capacity() -> None:
    settings = settings_from({"retention_writers": 2})

    budget = settings.max_pinned_bytes(1000, store_capacity=lambda: 10_000)

    assert (budget.pinned_bytes, budget.source) == (4500, "store capacity")


def test_an_unknown_capacity_leaves_an_engine_lending_nothing_pinning_nothing() -> None:
    budget = settings_from(None).max_pinned_bytes(0, store_capacity=lambda: None)

    assert budget == PinnedBudget(0, "lent, capacity unknown")


def test_an_unknown_capacity_falls_back_to_what_the_worker_lends() -> None:
    settings = settings_from({"retention_writers": 2})

    budget = settings.max_pinned_bytes(1000, store_capacity=lambda: None)

    assert budget == PinnedBudget(900, "lent, capacity unknown")


def test_a_store_reporting_no_memory_counts_as_an_unknown_capacity() -> None:
    budget = settings_from(None).max_pinned_bytes(0, store_capacity=lambda: 0)

    assert budget.source == "lent, capacity unknown"


def test_retention_max_pinned_overrides_the_store_capacity() -> None:
    settings = settings_from({"retention_max_pinned": "64MB", "retention_writers": 4})

    budget = settings.max_pinned_bytes(0, putting_ranks=8, store_capacity=_capacity_not_read)

    assert budget == PinnedBudget(64 << 20, "retention_max_pinned")


def test_retention_off_pins_nothing_whatever_the_store_capacity() -> None:
    settings = settings_from({"retention": False})

    budget = settings.max_pinned_bytes(0, store_capacity=_capacity_not_read)

    assert budget == PinnedBudget(0, "retention off")


@pytest.mark.parametrize("value", [0, -1, "2", 1.5])
def test_retention_writers_is_a_positive_whole_count(value: object) -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.retention_writers"):
        settings_from({"retention_writers": value})
