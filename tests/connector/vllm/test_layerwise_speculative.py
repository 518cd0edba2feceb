"""Layer by layer under a speculative head that drafts from the target's hidden states (EAGLE), in the real engine.

The head's attention layer is one more layer of every object, which the drafter
reads after the target's forward (when the step's loads have settled). In a module
of its own: an in-process engine's worker connector is the process's, so one
engine runs at a time (``test_speculative.py`` keeps another for its module).
"""

from __future__ import annotations

from typing import Any

from kvpipe.connector.engines import launch

from . import engine
from .test_speculative import SHORT_HIT, SPECULATIVE


def test_under_an_eagle_head_a_prefix_loads_and_saves_layer_by_layer_with_the_same_tokens(
    store_section: dict[str, Any],
) -> None:
    """Its bytes are in by the time the drafter reads them, checked like every other layer's."""
    transfer = launch.kvpipe_transfer({"store": store_section, **engine.LAYERWISE}, load_failure_policy="recompute")
    with engine.running(transfer, speculative_config=SPECULATIVE) as llm:
        batch = engine.prompts(909)
        first, _ = engine.stored_by(llm, batch)
        again, counts = engine.rerun(llm, batch)

    assert again["connector_hits"] == 2 * SHORT_HIT
    assert again["tokens"] == first["tokens"]
    assert (counts["loads_layered"], counts["loads_layer_late"], counts["chunks_load_failed"]) == (2, 0, 0)
    assert counts["chunks_verified"] == 2 * SHORT_HIT // engine.BLOCK
    assert counts["saves_layered"] == 2
