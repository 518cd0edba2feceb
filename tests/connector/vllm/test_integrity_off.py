"""``integrity: off``: objects are checked for their size only, as before seals existed.

Kept as a specification of what the setting gives up: an object overwritten with
bytes of its size is loaded as it is and the engine computes on it. (The same
fault with seals on is recomputed: ``test_integrity.py``.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpipe.connector.engines.launch import close_llm, kvpipe_transfer
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.stages import seal_key

from . import engine


@pytest.fixture(scope="module")
def llm(store_section: dict[str, Any]) -> Iterator[Any]:
    extra = {"store": store_section, "staging_blocks": 64, "integrity": "off"}
    instance = engine.make_llm(kvpipe_transfer(extra, load_failure_policy="recompute"))
    yield instance
    close_llm(instance)


def test_without_seals_an_overwritten_object_reaches_the_engine(
    llm: Any, holder: MooncakeStore, reference: dict[int, list[list[int]]]
) -> None:
    batch = engine.prompts(66)
    _, records = engine.stored_by(llm, batch)
    keys = list(dict.fromkeys(record.key for record in records))
    assert holder.batch_is_exist([seal_key(key) for key in keys]) == [0] * len(keys)  # none written
    engine.overwrite(holder, keys, torch.randint(0, 255, (records[0].size,), dtype=torch.uint8))

    assert llm.reset_prefix_cache()
    again = engine.generate(llm, batch)

    assert again["cached"] == [engine.FULL_HIT, engine.FULL_HIT]
    assert again["tokens"] != reference[66]
