"""After a ``kvpipe run`` of each shipped config, every object it wrote carries a seal (issue 55).

Each config's workload, model and save settings run on the memory store with room
for everything (hybrid.yaml's own store is too small by design: an anchor evicted
takes its seal along, and the rest of its span is unverified, as docs/integrity.md
says), then the scrubber of ``kvpipe inspect --verify`` judges every object the run
offered. The real master's case is tests/connector/cli/test_run_mooncake.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.connector.cli.inspect.figures import Verification
from kvpipe.connector.cli.inspect.verify import Scrub, verify_keys
from kvpipe.connector.cli.usage import load_run_config
from kvpipe.connector.run.job import RunResult, run
from kvpipe.connector.store.memory import MemoryStore

CONFIGS = sorted((Path(__file__).parents[3] / "configs").glob("*.yaml"))
ROOM = 4 << 30


@pytest.fixture(scope="module", params=CONFIGS, ids=[path.name for path in CONFIGS])
def scrubbed(request: pytest.FixtureRequest) -> tuple[RunResult, Verification]:
    """The config's run on a memory store with room, and the scrubber's verdicts on every key it offered."""
    config = load_run_config(request.param, ["store={kind: memory}"])
    store = MemoryStore(ROOM)
    result = run(config, store=store)
    return result, verify_keys(Scrub(store), result.objects)


def test_the_scrubber_finds_every_object_a_run_of_a_shipped_config_wrote_sealed(
    scrubbed: tuple[RunResult, Verification],
) -> None:
    result, verification = scrubbed

    assert verification.objects == result.report["objects"]["distinct_keys"] > 0
    assert dict(verification.verdicts) == {"ok": verification.objects}


def test_a_run_of_a_shipped_config_reports_no_object_unsealed(scrubbed: tuple[RunResult, Verification]) -> None:
    result, _ = scrubbed

    assert result.report["objects"]["unsealed"] == 0
