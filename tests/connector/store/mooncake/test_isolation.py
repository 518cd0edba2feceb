"""Isolation: a spawned master is reachable from this machine only, tenants' objects stay
apart, and no command line is ever handed to a shell."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvpipe.connector.store.mooncake.master import LOOPBACK, LocalMaster
from kvpipe.connector.store.protocol import Store
from kvpipe.pipeline import Outcome, Pipeline
from kvpipe.stages import (
    KVCache,
    LookupPlan,
    LookupRequest,
    default_save_graph,
    storable_groups,
)

from ....stages.kv_fixtures import KVFixture, make_kv, make_request

SOURCES = Path(__file__).parents[4]
PACKAGES = ("pipeline", "stages", "connector")
TOKENS = 64  # four 16-token chunks


# -- the spawned master ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def listening() -> Iterator[tuple[LocalMaster, dict[int, str]]]:
    """A spawned master and the address each of its listening ports is bound to."""
    with LocalMaster() as master:
        assert master.pid is not None
        connections = psutil.Process(master.pid).net_connections(kind="inet")
        yield master, {c.laddr.port: c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN}


def test_the_master_listens_on_its_two_ports_and_no_other(listening):
    master, bound = listening
    assert set(bound) == {master.endpoints.rpc_port, master.endpoints.metrics_port}


@pytest.mark.parametrize("port", ["rpc_port", "metrics_port"])
def test_the_master_port_is_bound_to_loopback_only(listening, port):
    master, bound = listening
    assert bound[getattr(master.endpoints, port)] == LOOPBACK


def test_clients_of_a_spawned_master_exchange_metadata_peer_to_peer(listening):
    """No HTTP metadata server: mooncake_master binds that one to 0.0.0.0 whatever it is told."""
    master, _ = listening
    assert master.endpoints.metadata_server == "P2PHANDSHAKE"


# -- cache prefixes --------------------------------------------------------------------------


async def save(fixture: KVFixture, store: Store, request_id: str) -> None:
    """One request of ``TOKENS`` tokens through the default save pipeline, every object put."""
    request = make_request(fixture.kv, TOKENS, request_id=request_id)
    async with Pipeline(default_save_graph(fixture.kv, store, enable_group_semantics=True)) as pipeline:
        job = await (await pipeline.submit(request)).finished()
    assert (job.outcome, job.counts["put"]) == (Outcome.OK, TOKENS // 16 * len(fixture.kv.shards))


def hit_tokens(kv: KVCache, store: Store, request_id: str) -> int:
    """What a lookup through ``kv``'s namespaces finds of the saved request ``request_id``."""
    saved = make_request(kv, TOKENS, request_id=request_id)
    request = LookupRequest(request_id, saved.block_hashes, num_tokens=TOKENS + 1)
    groups = storable_groups(kv)
    plan = LookupPlan(groups, kv.shards, kv.hash_block_size, request)
    keys = plan.keys
    exists = {key: code == 1 for key, code in zip(keys, store.batch_is_exist(list(keys)), strict=True)}
    return plan.hit(exists)


@pytest.fixture
def tenant_a(store: Store) -> Iterator[KVFixture]:
    """A two-rank cache under cache prefix "a", its memory registered with ``store``."""
    fixture = make_kv(shards=2, cache_prefix="a")
    tensors = [tensor for per_layer in fixture.tensors.values() for tensor in per_layer]
    for tensor in tensors:
        assert store.register_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size()) == 0
    yield fixture
    for tensor in tensors:
        store.unregister_buffer(tensor.data_ptr())


async def test_objects_saved_under_one_cache_prefix_are_no_hits_under_another(store, tenant_a):
    await save(tenant_a, store, "shared-prompt")

    same_tenant = hit_tokens(tenant_a.kv, store, "shared-prompt")
    other_tenant = hit_tokens(make_kv(shards=2, cache_prefix="b").kv, store, "shared-prompt")
    no_prefix = hit_tokens(make_kv(shards=2).kv, store, "shared-prompt")

    assert (same_tenant, other_tenant, no_prefix) == (TOKENS, 0, 0)


# -- no shell --------------------------------------------------------------------------------


def python_sources() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (SOURCES / package).rglob("*.py"))


def calls_in(path: Path) -> Iterator[ast.Call]:
    yield from (
        node for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.Call)
    )


def call_name(call: ast.Call) -> str:
    """``subprocess.Popen(...)`` -> ``"subprocess.Popen"``; ``""`` for calls of computed things."""
    parts: list[str] = []
    func = call.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


SUBPROCESS_CALLS = {
    "subprocess.run",
    "subprocess.Popen",
    "subprocess.call",
    "subprocess.check_call",
    "subprocess.check_output",
}
SHELL_CALLS = {"os.system", "os.popen", "asyncio.create_subprocess_shell", "subprocess.getoutput"}


def test_the_sources_are_found():
    assert {path.parent.name for path in python_sources()} >= set(PACKAGES)


def test_no_call_passes_shell_true():
    offenders = [
        f"{path.relative_to(SOURCES)}:{call.lineno}"
        for path in python_sources()
        for call in calls_in(path)
        for keyword in call.keywords
        if keyword.arg == "shell"
        and not (isinstance(keyword.value, ast.Constant) and keyword.value.value is False)
    ]
    assert offenders == []


def test_no_call_hands_a_command_line_to_a_shell():
    offenders = [
        f"{path.relative_to(SOURCES)}:{call.lineno} {call_name(call)}"
        for path in python_sources()
        for call in calls_in(path)
        if call_name(call) in SHELL_CALLS
    ]
    assert offenders == []


def test_subprocess_is_called_through_its_module_so_every_call_is_seen():
    imported_names = [
        f"{path.relative_to(SOURCES)}:{node.lineno}"
        for path in python_sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "subprocess"
    ]
    assert imported_names == []


def names_bound_to_lists(path: Path) -> set[str]:
    """The names a file assigns a list literal to, e.g. ``command = [binary, "--port=1"]``."""
    return {
        target.id
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def is_argument_list(argument: ast.expr, list_names: set[str]) -> bool:
    return isinstance(argument, ast.List) or (isinstance(argument, ast.Name) and argument.id in list_names)


def test_subprocesses_are_started_with_argument_lists():
    started = [
        (path, call)
        for path in python_sources()
        for call in calls_in(path)
        if call_name(call) in SUBPROCESS_CALLS
    ]
    assert started, "the master is started with subprocess.Popen: this test must see it"
    not_lists = [
        f"{path.relative_to(SOURCES)}:{call.lineno}"
        for path, call in started
        if not (call.args and is_argument_list(call.args[0], names_bound_to_lists(path)))
    ]
    assert not_lists == []
