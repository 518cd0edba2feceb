"""The report on one model's objects in a live store, built in named steps from the master's admin HTTP.

The steps, each a function: list the store's keys and sort out the model's
(:func:`_listing`); ask which are still stored, with their replicas
(:func:`_stored`); say what every chunk should hold, from a run's workload or
from the shards seen (:func:`_expectation`); count each chunk by the run report's
own rule (:func:`_chunk_states`); then the bytes, the nodes and, if asked, the
verification. :mod:`.figures` says what each figure means.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvpipe.connector.run.check import ChunkCounts, count_chunks
from kvpipe.connector.store.mooncake.admin import AdminClient, Replica, Segment
from kvpipe.connector.store.mooncake.listening import is_listening
from kvpipe.connector.store.mooncake.master_address import split_host_port
from kvpipe.stages import KeyNamespace, StoreObject, key_model_name, object_key
from kvpipe.stages.keys import is_layer_seal_key, is_seal_key, parse_object_key, sealed_key

from .errors import InspectError, admin_errors
from .figures import InspectReport, NodeFigures, ShardId, ShardSource
from .replay import ExpectedRun, KeyNames, client_supports_group_ids
from .verify import Scrub, verify_objects

__all__ = ["ReportRequest", "build_report"]


@dataclass(frozen=True)
class ReportRequest:
    """What to report on: ``model`` (any spelling: its key part is used) under ``cache_prefix``.

    ``run``: the chunks are the run's, and absent ones are counted. Otherwise each
    chunk seen is expected to have the union of the shards seen, or
    ``store_groups`` x ``tp_ranks`` (pcp/dcp/pp ranks as seen) where given.
    ``master``: the master's address, as the report names it. ``probe_timeout_s``
    bounds each node's TCP probe. ``scrub``: also read and verify the objects (and
    repair) as it says.
    """

    model: str
    cache_prefix: str = ""
    store_groups: int | None = None
    tp_ranks: int | None = None
    run: ExpectedRun | None = None
    master: str | None = None
    probe_timeout_s: float = 0.5
    scrub: Scrub | None = None


@dataclass
class _Listing:
    """The store's keys, sorted out: the model's objects and seals, other models' keys, and the rest."""

    total: int = 0
    ours: dict[str, ShardId] = field(default_factory=dict)  # the model's objects, and their shard
    seals: list[str] = field(default_factory=list)  # the model's seals
    chunk_of: dict[str, bytes] = field(default_factory=dict)  # of the model's objects and seals
    others: Counter[tuple[str, str]] = field(default_factory=Counter)  # (model, cache prefix) -> keys
    unparsed: int = 0


@dataclass(frozen=True)
class _Stored:
    """The model's listed objects still stored, with their replicas and sizes, and its seals and their sizes."""

    present: dict[str, list[Replica]]
    seals: list[str]
    size: dict[str, int]
    seal_sizes: list[int]


@dataclass(frozen=True)
class _Expectation:
    """What every chunk should hold, and where that comes from."""

    source: ShardSource
    by_chunk: dict[bytes, list[StoreObject]]
    shards: set[ShardId]

    @property
    def keys(self) -> set[str]:
        return {record.key for records in self.by_chunk.values() for record in records}


def build_report(admin: AdminClient, request: ReportRequest) -> InspectReport:
    """The report on what the store behind ``admin`` holds of ``request``'s model.

    :raises InspectError: ``metrics`` when the admin HTTP fails; ``model`` when the
        store holds no object of the model and no run says what it should hold (the
        message lists what the store does hold); ``verify`` when the scrub's read
        memory cannot be registered.
    """
    model = key_model_name(request.model)
    with admin_errors():
        listing = _listing(admin.keys(), model, request.cache_prefix)
        if not listing.ours and request.run is None:
            raise _no_such_model(listing, model, request.cache_prefix)
        stored = _stored(admin, listing)
        expectation = _expectation(request, model, listing, stored)
        state_of, counts = _chunk_states(expectation.by_chunk, stored.present)
        nodes = _nodes(admin.segments(), stored.present, state_of, request.probe_timeout_s)
    verification = (
        None
        if request.scrub is None
        else verify_objects(request.scrub, stored.present, stored.seals, listing.chunk_of, nodes)
    )
    size = stored.size
    expected_keys = expectation.keys
    unexpected = [key for key in stored.present if key not in expected_keys]
    run = request.run
    return InspectReport(
        admin=admin.address,
        master=request.master,
        model=model,
        cache_prefix=request.cache_prefix,
        objects=len(stored.present),
        bytes=sum(size.values()),
        replicas=sum(len(copies) for copies in stored.present.values()),
        seals=len(stored.seal_sizes),
        seal_bytes=sum(stored.seal_sizes),
        other_keys=listing.total - len(listing.ours) - len(listing.seals),
        other_models=[(name, prefix, count) for (name, prefix), count in listing.others.most_common()],
        unparsed_keys=listing.unparsed,
        shard_source=expectation.source,
        store_groups_expected=sorted({shard.store_group for shard in expectation.shards}),
        ranks_expected=sorted({(shard.tp, shard.pcp, shard.dcp, shard.pp) for shard in expectation.shards}),
        expected_objects=len(expected_keys),
        chunks=counts,
        absent_known=run is not None,
        complete_bytes=_bytes_in(state_of, size, "complete"),
        partial_bytes=_bytes_in(state_of, size, "partial"),
        unexpected_objects=len(unexpected),
        unexpected_bytes=sum(size[key] for key in unexpected),
        per_store_group=_per_store_group(stored.present, listing.ours, size),
        client_supports_group_ids=client_supports_group_ids(),
        run_requests_group_ids=None if run is None else run.requests_group_ids,
        run_config=None if run is None else run.config,
        size_mismatches=None if run is None else _size_mismatches(run.objects, size),
        nodes=nodes,
        verification=verification,
    )


def _listing(keys: Sequence[str], model: str, cache_prefix: str) -> _Listing:
    """``keys`` sorted out for ``model`` under ``cache_prefix``: a seal counts with its object's model."""
    listing = _Listing(total=len(keys))
    for key in keys:
        if is_layer_seal_key(key):
            continue  # a seal's layer checksums (stages/layer_seals.py): read by layer-wise loads only
        parts = parse_object_key(sealed_key(key))
        if parts is None:
            listing.unparsed += 1
            continue
        ns = parts.namespace
        if ns.model != model or ns.cache_prefix != cache_prefix:
            listing.others[(ns.model, ns.cache_prefix)] += 1
            continue
        listing.chunk_of[key] = parts.chunk_hash
        if is_seal_key(key):
            listing.seals.append(key)
        else:
            listing.ours[key] = ShardId(parts.store_group, ns.tp_rank, ns.pcp_rank, ns.dcp_rank, ns.pp_rank)
    return listing


def _no_such_model(listing: _Listing, model: str, cache_prefix: str) -> InspectError:
    """The error for a store without the model: it names the models (up to five) the store does hold."""
    held = ", ".join(
        f"{name!r} (cache prefix {prefix!r}): {count}"
        for (name, prefix), count in listing.others.most_common(5)
    )
    holds = f"it holds {held}" if held else "it holds no object in kvpipe's key format"
    more = f" and {len(listing.others) - 5} more" if len(listing.others) > 5 else ""
    unparsed = f" (and {listing.unparsed} keys in no kvpipe format)" if listing.unparsed else ""
    return InspectError(
        "model",
        f"the store holds no object of model {model!r} with cache prefix {cache_prefix!r}; {holds}{more}{unparsed}",
    )


def _stored(admin: AdminClient, listing: _Listing) -> _Stored:
    """The listed objects and seals of the model still stored (one batched query: no read lease).

    :raises AdminError: the admin HTTP fails.
    """
    stored = admin.replicas([*listing.ours, *listing.seals])
    present = {key: copies for key, copies in stored.items() if key in listing.ours}
    return _Stored(
        present=present,
        seals=[key for key in listing.seals if key in stored],
        size={key: copies[0].size for key, copies in present.items()},
        seal_sizes=[stored[key][0].size for key in listing.seals if key in stored],
    )


def _expectation(request: ReportRequest, model: str, listing: _Listing, stored: _Stored) -> _Expectation:
    """What every chunk should hold: the run's objects if given, else the expected shards of each chunk seen.

    :raises InspectError: (``run``) the run makes a key in no known format.
    """
    if request.run is not None:
        by_chunk: dict[bytes, list[StoreObject]] = {}
        for record in request.run.objects:
            by_chunk.setdefault(record.chunk_hash, []).append(record)
        return _Expectation("run", by_chunk, {_shard_of(record.key) for record in request.run.objects})
    seen = {listing.ours[key] for key in stored.present}
    shards = _expected_shards(seen, request.store_groups, request.tp_ranks)
    source: ShardSource = "seen" if request.store_groups is None and request.tp_ranks is None else "flags"
    namespaces = {
        shard: KeyNamespace(model, request.cache_prefix, shard.tp, shard.pcp, shard.dcp, shard.pp)
        for shard in shards
    }
    chunks_seen = {listing.chunk_of[key] for key in stored.present if listing.ours[key] in shards}
    by_chunk = {
        chunk_hash: [
            StoreObject(
                object_key(namespaces[shard], shard.store_group, chunk_hash),
                chunk_hash,
                shard.store_group,
                (),
            )
            for shard in sorted(shards)
        ]
        for chunk_hash in sorted(chunks_seen)
    }
    return _Expectation(source, by_chunk, shards)


def _shard_of(key: str) -> ShardId:
    """The shard of one of the run's keys.

    :raises InspectError: (``run``) the key is in no known format (the run's keys are
        :func:`object_key`'s: cannot happen).
    """
    parts = parse_object_key(key)
    if parts is None:
        raise InspectError("run", f"the run makes a key in no known format: {key!r}")
    ns = parts.namespace
    return ShardId(parts.store_group, ns.tp_rank, ns.pcp_rank, ns.dcp_rank, ns.pp_rank)


def _expected_shards(seen: set[ShardId], store_groups: int | None, tp_ranks: int | None) -> set[ShardId]:
    """The union of ``seen``, with the store groups and/or tp ranks replaced by ``range(n)`` where given."""
    groups = sorted({s.store_group for s in seen}) if store_groups is None else list(range(store_groups))
    ranks = {(s.tp, s.pcp, s.dcp, s.pp) for s in seen}
    if tp_ranks is not None:
        rest = {(pcp, dcp, pp) for _, pcp, dcp, pp in ranks} or {(0, 0, 0)}
        ranks = {(tp, *other) for tp in range(tp_ranks) for other in rest}
    return {ShardId(group, *rank) for group in groups for rank in ranks}


def _chunk_states(
    by_chunk: Mapping[bytes, Sequence[StoreObject]], present: Mapping[str, object]
) -> tuple[dict[str, str], ChunkCounts]:
    """Each expected object's chunk state (complete, partial, absent), and the chunk counts.

    Each chunk is counted by the run report's own rule (:func:`count_chunks`, on a
    store of the ``present`` key names), one chunk at a time to know its bytes.
    """
    view = KeyNames(present)
    tally: Counter[str] = Counter()
    state_of: dict[str, str] = {}
    for records in by_chunk.values():
        one = count_chunks(view, records)
        state = "complete" if one.complete else "partial" if one.partial else "absent"
        tally[state] += 1
        for record in records:
            state_of[record.key] = state
    return state_of, ChunkCounts(len(by_chunk), tally["complete"], tally["partial"], tally["absent"])


def _bytes_in(state_of: Mapping[str, str], size: Mapping[str, int], state: str) -> int:
    """The bytes of the stored objects whose chunk is in ``state``."""
    return sum(size[key] for key, chunk_state in state_of.items() if chunk_state == state and key in size)


def _per_store_group(
    present: Mapping[str, object], ours: Mapping[str, ShardId], size: Mapping[str, int]
) -> dict[int, tuple[int, int]]:
    """Store group -> (objects, bytes) of the stored objects."""
    per_group: dict[int, tuple[int, int]] = {}
    for key in present:
        objects, nbytes = per_group.get(ours[key].store_group, (0, 0))
        per_group[ours[key].store_group] = (objects + 1, nbytes + size[key])
    return per_group


def _size_mismatches(expected: Sequence[StoreObject], size: Mapping[str, int]) -> int:
    """How many of the run's objects are stored with another size than the run's."""
    return sum(1 for record in expected if record.key in size and size[record.key] != record.size)


def _nodes(
    segments: Sequence[Segment] | None,
    present: Mapping[str, Sequence[Replica]],
    state_of: Mapping[str, str],
    probe_timeout_s: float,
) -> list[NodeFigures]:
    """Per segment (every one the master lists, and any endpoint a replica names besides), probed by TCP."""
    nodes: dict[str, NodeFigures] = {}
    for segment in segments or []:
        nodes[segment.endpoint] = NodeFigures(
            segment.name,
            segment.endpoint,
            used_bytes=segment.used_bytes,
            capacity_bytes=segment.capacity_bytes,
        )
    for key, copies in present.items():
        for copy in copies:
            node = nodes.setdefault(copy.endpoint, NodeFigures(None, copy.endpoint))
            node.replicas += 1
            node.bytes += copy.size
            if state_of.get(key) == "complete":
                node.complete_bytes += copy.size
            elif state_of.get(key) == "partial":
                node.partial_bytes += copy.size
    for node in nodes.values():
        try:
            host, port = split_host_port(node.endpoint)
        except ValueError:
            continue  # not in memory, or no address: nothing to probe
        node.reachable = is_listening(host, port, timeout_s=probe_timeout_s)
    return sorted(nodes.values(), key=lambda node: (node.segment is None, node.segment or node.endpoint))
