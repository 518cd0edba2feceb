"""The real HTTP server: ``vllm serve`` with kvpipe's connector, twice on one master.

Server 1 answers token-id prompts over HTTP and stores their full blocks; server 2,
a restart on the same master (the objects live in this module's segment holder, not
in the server), answers the same prompts from what server 1 stored. Each server's
``/metrics`` is scraped once its figures have settled: vLLM's own hit counters and
kvpipe's series must agree with each other and with what the master holds.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvpipe.connector.engines import launch
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster
from kvpipe.stages.integrity import SEAL_SIZE
from kvpipe.stages.keys import key_chunk_hex

from . import engine
from .replay import Replayer, kvpipe_events
from .server import Completion, Scrape, VllmServer

pytestmark = pytest.mark.engine

#: prompt lengths: part of a block over, exactly three blocks (vLLM recomputes the last), more
PROMPT_LENGTHS = (300, 384, 450)
MAX_TOKENS = 8
SEED = 1313  # this module's own master: any prompts would do
#: a prompt under one block: it stores and looks up nothing, it only makes an engine step
NUDGE = list(range(1, 41))
SETTLE_S = 60.0
QUIET_S = 1.0

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
#: one stored object: a block of every layer, K and V (kv heads x head size = hidden size), bf16
OBJECT_BYTES = (
    launch.TINY_LLAMA["num_hidden_layers"] * engine.BLOCK * 2 * launch.TINY_LLAMA["hidden_size"] * 2
)
MODEL = engine.MODEL_DIR.name  # the model part of every key

#: kvpipe's series in /metrics (sample names as exposed; the histogram by its base name)
KVPIPE_SERIES = (
    "kvpipe:store_operation_seconds",
    "kvpipe:store_operation_keys_total",
    "kvpipe:store_operation_bytes_total",
    "kvpipe:store_operation_failed_keys_total",
    "kvpipe:objects_total",
    "kvpipe:lookup_hit_tokens_total",
    "kvpipe:loads_total",
    "kvpipe:chunks_loaded_total",
    "kvpipe:loads_spared_total",
    "kvpipe:saves_submitted_total",
    "kvpipe:saves_dropped_no_staging_total",
    "kvpipe:stage_queue_depth",
    "kvpipe:stage_dropped_total",
    "kvpipe:breaker_state",
    "kvpipe:staging_slots_in_use",
    "kvpipe:staging_slots",
)


def prompts() -> list[list[int]]:
    rng = random.Random(SEED)
    return [[rng.randrange(1024) for _ in range(length)] for length in PROMPT_LENGTHS]


def stored_blocks(length: int) -> int:
    """The full blocks of a prompt: what a save stores (decode tokens are not saved)."""
    return length // engine.BLOCK


def expected_hit(length: int) -> int:
    """The whole blocks of a stored prompt a second server loads: never the prompt's last token,
    which vLLM must compute (a prompt of exactly ``n`` blocks hits ``n - 1``)."""
    return (length - 1) // engine.BLOCK * engine.BLOCK


@dataclass(frozen=True)
class ServerRun:
    completions: list[Completion]
    scrape: Scrape = field(repr=False)  # once its figures stopped changing
    keys: list[str] = field(repr=False)  # the model's keys the master held then
    start_seconds: float | None
    settle_seconds: float
    events: list[object] = field(repr=False)  # what vLLM's KV-event publisher sent

    @property
    def announced(self) -> list[int]:
        """The block hashes of kvpipe's BlockStored events."""
        return [h for e in kvpipe_events(self.events, BlockStored) for h in e.block_hashes]

    @property
    def external_hits(self) -> float:
        return self.scrape.total(EXTERNAL_HITS)


@dataclass(frozen=True)
class Afterwards:
    """Server 2 once its run was judged: an announced object went, and the deployment was reset."""

    gone: str  # the key removed behind the server's back
    events: list[object] = field(repr=False)  # published after it was asked for again
    reset: dict[str, object]  # /reset_prefix_cache?reset_external=true's answer
    keys_after_reset: list[str]


@dataclass(frozen=True)
class Runs:
    first: ServerRun
    second: ServerRun
    afterwards: Afterwards


def model_keys(master: LocalMaster) -> list[str]:
    assert master.endpoints is not None
    return [key for key in launch.stored_keys(master.endpoints) if key.split("@", 1)[0] == MODEL]


def _figures(scrape: Scrape) -> tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]:
    """What must stop changing: kvpipe's series and vLLM's prefix-cache hits (a nudge adds queries)."""
    return tuple(
        sorted(
            (s.name, tuple(sorted(s.labels.items())), s.value)
            for s in scrape.matching("kvpipe:") + scrape.matching("vllm:")
            if s.name.startswith("kvpipe:") or "prefix_cache_hits" in s.name
        )
    )


def settle(server: VllmServer, master: LocalMaster, want_keys: int) -> tuple[Scrape, list[str]]:
    """Nudge the engine (connector stats reach /metrics with a step's) until the figures hold still.

    Settled: the master holds ``want_keys`` of the model's keys and the figures have not
    changed for QUIET_S, over at least two nudges. At the deadline the last scrape is
    returned as it is: the tests then say what is wrong with it.
    """
    deadline = time.monotonic() + SETTLE_S
    last: tuple[object, ...] | None = None
    since = time.monotonic()
    same = 0
    while True:
        server.complete(NUDGE, 1)
        scrape = server.scrape()
        keys = model_keys(master)
        figures = (_figures(scrape), len(keys))
        now = time.monotonic()
        if figures == last:
            same += 1
        else:
            last, since, same = figures, now, 0
        if (same >= 2 and now - since >= QUIET_S and len(keys) >= want_keys) or now > deadline:
            return scrape, keys
        time.sleep(0.2)


def gone_then_reset(
    server: VllmServer, replayer: Replayer, run: ServerRun, master: LocalMaster, holder: MooncakeStore
) -> Afterwards:
    """Remove the object server 2 announced, ask for its prompt again, then reset the deployment over HTTP."""
    [gone] = [key for key in model_keys(master) if key_block_hash(key) in run.announced]
    assert holder.remove(gone, force=True) == 0
    assert server.post("/reset_prefix_cache") == {"success": True}  # vLLM's own cache only
    # a prompt that goes on past it: its lookup asks for the chunk (a prompt's own last block it never
    # asks for, vLLM computes that) and finds it absent
    server.complete(prompts()[1] + NUDGE, MAX_TOKENS)
    events = replayer.until(lambda found: bool(kvpipe_events(found, BlockRemoved)))
    reset = server.post("/reset_prefix_cache?reset_external=true")
    return Afterwards(gone, events, reset, model_keys(master))


def serve(
    log: Path,
    master: LocalMaster,
    want_keys: int,
    want_announced: int,
    then: Callable[[VllmServer, Replayer, ServerRun], Afterwards] | None = None,
) -> tuple[ServerRun, Afterwards | None]:
    assert master.endpoints is not None
    transfer = launch.kvpipe_transfer({"store": launch.store_section(master.endpoints)})
    replay = f"ipc://{log.with_suffix('.replay')}"
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{log.with_suffix('.events')}",
        "replay_endpoint": replay,
    }
    arguments = ("--kv-events-config", json.dumps(events))
    dev_mode = {"VLLM_SERVER_DEV_MODE": "1"}  # serves /reset_prefix_cache
    with (
        VllmServer(log, transfer=transfer, extra_args=arguments, env=dev_mode) as server,
        Replayer(replay) as replayer,
    ):
        completions = [server.complete(prompt, MAX_TOKENS) for prompt in prompts()]
        began = time.monotonic()
        scrape, keys = settle(server, master, want_keys)
        settled = round(time.monotonic() - began, 1)
        log.with_suffix(".metrics").write_text(scrape.text)  # what the tests judged, beside the log
        found = replayer.until(lambda found: len(kvpipe_events(found, BlockStored)) >= want_announced)
        log.with_suffix(".kv-events.json").write_bytes(msgspec.json.encode(found))  # beside the metrics
        run = ServerRun(completions, scrape, keys, server.start_seconds, settled, found)
        return run, (None if then is None else then(server, replayer, run))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    logs = tmp_path_factory.mktemp("vllm-serve")
    stored = sum(stored_blocks(length) for length in PROMPT_LENGTHS)
    with LocalMaster() as master:
        assert master.endpoints is not None
        with launch.segment_holder(master.endpoints, "256MB") as holder:
            first, _ = serve(logs / "server-1.log", master, want_keys=stored, want_announced=stored)
            # the 384-token prompt's last block is recomputed and saved again (as existing)
            second, afterwards = serve(
                logs / "server-2.log",
                master,
                want_keys=stored,
                want_announced=1,
                then=lambda server, replayer, run: gone_then_reset(server, replayer, run, master, holder),
            )
    print(
        f"\nvllm serve: started in {first.start_seconds} s and {second.start_seconds} s, "
        f"settled in {first.settle_seconds} s and {second.settle_seconds} s; "
        f"keys {len(first.keys)} -> {len(second.keys)}; external hits "
        f"{first.external_hits:g} -> {second.external_hits:g}; cached "
        f"{[c.cached_tokens for c in first.completions]} -> {[c.cached_tokens for c in second.completions]}"
    )
    assert afterwards is not None
    (logs / "server-2-afterwards.kv-events.json").write_bytes(msgspec.json.encode(afterwards.events))
    return Runs(first, second, afterwards)


def test_the_restarted_server_answers_as_the_first(runs: Runs) -> None:
    first = [c.tokens for c in runs.first.completions]
    assert [len(tokens) for tokens in first] == [MAX_TOKENS] * len(PROMPT_LENGTHS)
    assert [c.tokens for c in runs.second.completions] == first


def test_the_first_server_stores_every_full_block(runs: Runs) -> None:
    assert [c.cached_tokens for c in runs.first.completions] == [0] * len(PROMPT_LENGTHS)
    assert runs.first.external_hits == 0
    assert len(runs.first.keys) == sum(stored_blocks(length) for length in PROMPT_LENGTHS)


def test_the_restarted_server_hits_what_the_first_stored(runs: Runs) -> None:
    hits = [expected_hit(length) for length in PROMPT_LENGTHS]
    assert runs.second.external_hits > 0
    assert runs.second.external_hits == sum(hits)
    assert [c.cached_tokens for c in runs.second.completions] == hits  # all of it the connector's
    assert sorted(runs.second.keys) == sorted(runs.first.keys)  # nothing new stored


def test_kvpipe_series_are_served_with_vllm_labels(runs: Runs) -> None:
    for run in (runs.first, runs.second):
        missing = [series for series in KVPIPE_SERIES if not run.scrape.has(series)]
        assert not missing, missing
        samples = run.scrape.matching("kvpipe:")
        assert samples
        unlabelled = {s.name for s in samples if not {"model_name", "engine"} <= s.labels.keys()}
        assert not unlabelled, unlabelled


def test_kvpipe_save_counts_agree_with_the_master(runs: Runs) -> None:
    scrape = runs.first.scrape
    stored = len(runs.first.keys)
    assert stored > 0
    assert scrape.total("kvpipe:objects_total", status="put") == stored
    # the objects go with their seals: one per request's run of up to SEAL_SPAN chunks put together
    seals = scrape.total("kvpipe:store_operation_keys_total", operation="put", status="ok") - stored
    assert len(PROMPT_LENGTHS) <= seals <= stored
    assert scrape.total("kvpipe:store_operation_bytes_total", operation="put", status="ok") == (
        stored * OBJECT_BYTES + seals * SEAL_SIZE
    )
    assert scrape.total("kvpipe:objects_total", status="failed") == 0
    assert scrape.total("kvpipe:store_operation_failed_keys_total") == 0


def test_kvpipe_lookup_counts_agree_with_vllm_after_the_restart(runs: Runs) -> None:
    scrape = runs.second.scrape
    assert runs.second.external_hits > 0
    assert scrape.total("kvpipe:lookup_hit_tokens_total") == runs.second.external_hits
    chunks = runs.second.external_hits // engine.BLOCK  # one object per block: one store group
    assert scrape.total("kvpipe:chunks_loaded_total") == chunks
    seals_read = scrape.total("kvpipe:store_operation_keys_total", operation="get", status="ok") - chunks
    assert len(PROMPT_LENGTHS) <= seals_read < chunks  # a seal vouches for a run of chunks
    assert scrape.total("kvpipe:chunks_verified_total") == chunks
    assert scrape.total("kvpipe:loads_total") == len(PROMPT_LENGTHS)
    assert scrape.total("kvpipe:objects_total", status="put") == 0  # nothing new to store


def key_block_hash(key: str) -> int:
    """The block hash a key names, as vLLM's KV events carry it (the low 64 bits of the chunk hash)."""
    return int(key_chunk_hex(key)[-16:], 16)


def test_the_first_server_announces_every_chunk_it_stored_once(runs: Runs) -> None:
    assert sorted(runs.first.announced) == sorted(key_block_hash(key) for key in runs.first.keys)


def test_a_restarted_server_announces_only_the_chunk_it_saved_again(runs: Runs) -> None:
    assert len(runs.second.announced) == 1
    assert set(runs.second.announced) <= {key_block_hash(key) for key in runs.first.keys}


def test_a_server_that_finds_an_announced_chunk_gone_publishes_its_removal(runs: Runs) -> None:
    removed = [h for e in kvpipe_events(runs.afterwards.events, BlockRemoved) for h in e.block_hashes]
    assert removed == [key_block_hash(runs.afterwards.gone)]


def test_a_reset_over_http_removes_the_deployment_s_objects(runs: Runs) -> None:
    assert runs.afterwards.reset == {"success": True}
    assert runs.afterwards.keys_after_reset == []
