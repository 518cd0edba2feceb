"""After a ``kvpipe run`` of each shipped config, every object it wrote carries a seal (issue 55).

Each config's workload, model and save settings run on the memory store with room
for everything (hybrid.yaml's own store is too small by design: an anchor evicted
takes its seal along, and the rest of its span is unverified, as docs/integrity.md
says), then the scrubber of ``kvpipe inspect --verify`` judges every object the run
offered. The real master's case is tests/connector/cli/test_run_mooncake.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest

from kvpipe.connector.cli.inspect.figures import Verification
from kvpipe.connector.cli.inspect.verify import Scrub, verify_keys
from kvpipe.connector.cli.usage import load_run_config
from kvpipe.connector.run.job import RunResult, run
from kvpipe.connector.store.memory import MemoryStore
from kvpipe.stages.store import EXISTS

CONFIGS = sorted((Path(__file__).parents[3] / "configs").glob("*.yaml"))
ROOM = 4 << 30


class Scrubbed(NamedTuple):
    result: RunResult
    verification: Verification  # the scrubber's verdicts on every key the run offered
    stored: int  # how many of those keys the store holds


@pytest.fixture(scope="module", params=CONFIGS, ids=[path.name for path in CONFIGS])
def scrubbed(request: pytest.FixtureRequest) -> Scrubbed:
    """The config's run on a memory store with room, and the scrubber's verdicts on every key it offered."""
    config = load_run_config(request.param, ["store={kind: memory}"])
    store = MemoryStore(ROOM)
    result = run(config, store=store)
    stored = sum(answer == EXISTS for answer in store.batch_is_exist(result.objects))
    return Scrubbed(result, verify_keys(Scrub(store), result.objects), stored)


def test_the_scrubber_finds_every_object_a_run_of_a_shipped_config_wrote_sealed(scrubbed: Scrubbed) -> None:
    assert scrubbed.verification.objects == scrubbed.stored > 0
    assert dict(scrubbed.verification.verdicts) == {"ok": scrubbed.stored}


def test_every_key_a_run_offered_is_stored_unless_its_put_was_skipped_or_failed(scrubbed: Scrubbed) -> None:
    """A config's slow-store throttle may skip puts on a busy machine: those keys are counted, never half there."""
    objects = scrubbed.result.report["objects"]
    assert objects["distinct_keys"] - scrubbed.stored <= objects["throttled"] + objects["failed"]


def test_a_run_of_a_shipped_config_reports_no_object_unsealed(scrubbed: Scrubbed) -> None:
    result = scrubbed.result

    assert result.report["objects"]["unsealed"] == 0
