"""``kvpipe inspect``'s outputs: the report as aligned text for a terminal, and as a PNG of two panels."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .figures import SCRUB_VERDICTS, InspectReport, Verification

__all__ = ["render_table", "write_png"]

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def _unit(nbytes: float) -> tuple[str, int]:
    """The largest binary unit that ``nbytes`` fills at least once (B for 0)."""
    return next(((name, scale) for name, scale in _UNITS if nbytes >= scale), ("B", 1))


def _size(nbytes: int) -> str:
    name, scale = _unit(nbytes)
    return f"{nbytes} B" if scale == 1 else f"{nbytes / scale:,.1f} {name}"


def _answer(known: bool | None, yes: str, no: str, unknown: str) -> str:
    """``yes`` or ``no`` for an answer known, ``unknown`` for None."""
    if known is None:
        return unknown
    return yes if known else no


def _ranks(ranks: Sequence[tuple[int, int, int, int]]) -> str:
    """``tp 0, 1`` when only tp varies (pcp, dcp, pp all 0), else every rank spelt out."""
    if all(rank[1:] == (0, 0, 0) for rank in ranks):
        return "tp " + ", ".join(str(rank[0]) for rank in ranks) if ranks else "none"
    return ", ".join("tp{} pcp{} dcp{} pp{}".format(*rank) for rank in ranks)


def render_table(report: InspectReport) -> str:
    """The report as aligned text for a terminal."""
    r, c = report, report.chunks
    absent = (
        f"{c.absent:,} absent"
        if r.absent_known
        else "absent unknown (give --run CONFIG: the chunks expected)"
    )
    source = {
        "seen": "as seen in the store",
        "flags": "from --groups/--tp-ranks",
        "run": f"from --run {r.run_config}",
    }
    groups = ", ".join(str(g) for g in r.store_groups_expected) or "none"
    others = "; ".join(f"{model!r} (prefix {p!r}) {n:,}" for model, p, n in r.other_models[:4])
    if len(r.other_models) > 4:
        others += f"; {len(r.other_models) - 4} more"
    client = _answer(
        r.client_supports_group_ids,
        "this Mooncake client supports them",
        "this Mooncake client has none",
        "no Mooncake client installed",
    )
    run = _answer(r.run_requests_group_ids, "; the run asks for them", "; the run does not ask for them", "")
    master = f", master {r.master}" if r.master else ""
    lines = [
        f"model         {r.model!r}, cache prefix {r.cache_prefix!r}  (admin HTTP {r.admin}{master})",
        f"objects       {r.objects:,} ({_size(r.bytes)}) in {r.replicas:,} replicas",
        f"seals         {r.seals:,} ({_size(r.seal_bytes)})",
        f"other keys    {r.other_keys:,}: {r.unparsed_keys:,} in no kvpipe/vLLM key format"
        + (f"; other models: {others}" if others else ""),
        f"chunks        {c.total:,}: {c.complete:,} complete, {c.partial:,} partial, {absent}",
        f"a chunk       store groups {groups} x {_ranks(r.ranks_expected)} ({source[r.shard_source]})",
        f"bytes         complete chunks {_size(r.complete_bytes)}, partial chunks {_size(r.partial_bytes)} "
        f"(partial/live {r.partial_ratio:.2%})",
    ]
    counts = [n for n, _ in r.per_store_group.values()]
    if r.shard_source != "run" and counts and 2 * min(counts) < max(counts):
        lines.append(
            "note          a store group holds under half the objects of another: a recurrent group (mamba) "
            "is stored at some chunks only, and those chunks count partial here; --run CONFIG knows which"
        )
    if r.unexpected_objects:
        lines.append(
            f"unexpected    {r.unexpected_objects:,} objects ({_size(r.unexpected_bytes)}) outside the expected shards"
            + (" (not among the run's)" if r.shard_source == "run" else "")
        )
    if r.size_mismatches:
        lines.append(
            f"WARNING       {r.size_mismatches:,} objects differ in size from the run's: another layout?"
        )
    lines += [
        "store groups  "
        + "; ".join(f"{g}: {n:,} objects, {_size(b)}" for g, (n, b) in sorted(r.per_store_group.items())),
        f"group ids     {client}{run}; which objects carry one is not observable",
    ]
    if r.verification is not None:
        lines += _verification_lines(r.verification, r.objects)
    verdicts = "" if r.verification is None else "".join(f" {name:>10}" for name in SCRUB_VERDICTS)
    lines += [
        "",
        f"{'node (segment)':<24} {'endpoint':<22} {'replicas':>9} {'bytes':>11} {'partial':>11} "
        f"{'segment used':>12} {'capacity':>11} {'reachable':>9}{verdicts}",
    ]
    for node in r.nodes:
        reachable = _answer(node.reachable, "yes", "NO", "-")
        used = "?" if node.used_bytes is None else _size(node.used_bytes)
        capacity = "?" if node.capacity_bytes is None else _size(node.capacity_bytes)
        found = "".join(f" {node.verify[name]:>10,}" for name in SCRUB_VERDICTS) if node.verify else ""
        lines.append(
            f"{node.segment or '(not listed)':<24} {node.endpoint or '(not in memory)':<22} {node.replicas:>9,} "
            f"{_size(node.bytes):>11} {_size(node.partial_bytes):>11} {used:>12} {capacity:>11} {reachable:>9}"
            f"{found}"
        )
    return "\n".join(lines)


def _verification_lines(v: Verification, objects: int) -> list[str]:
    read = (
        f"{v.objects:,} of {objects:,} objects, a random sample"
        if v.objects < objects
        else f"{v.objects:,} objects"
    )
    counts = ", ".join(f"{v.verdicts[name]:,} {name}" for name in SCRUB_VERDICTS)
    reasons = "; ".join(f"{reason}: {n:,}" for reason, n in v.unreadable_reasons.most_common())
    lines = [f"verified      {read} ({_size(v.bytes)}): {counts}" + (f" ({reasons})" if reasons else "")]
    if v.corrupt_keys:
        more = f" and {len(v.corrupt_keys) - 3:,} more" if len(v.corrupt_keys) > 3 else ""
        lines.append(
            f"corrupt       {len(v.corrupt_keys):,} objects of {v.corrupt_chunks:,} chunks: "
            + ", ".join(v.corrupt_keys[:3])
            + more
        )
    if v.fingerprints:
        lines.append(
            "fingerprints  " + "; ".join(f"{hex_} {n:,}" for hex_, n in v.fingerprints.most_common())
        )
    if len(v.fingerprints) > 1:
        lines.append(
            f"WARNING       {len(v.fingerprints)} configuration fingerprints under one model name: engines of "
            "different configurations (dtype, layout, revision) share these keys"
        )
    if v.removed is not None:
        failed = f"; {v.remove_failures:,} removals failed" if v.remove_failures else ""
        lines.append(
            f"repaired      removed {v.removed:,} keys (the objects and seals of the corrupt chunks){failed}"
        )
    return lines


def write_png(report: InspectReport, path: Path) -> Path:
    """Two panels: chunks complete / partial / absent, and each node's bytes of complete and partial chunks."""
    from kvpipe.connector.bench.plot import new_figure, save_figure

    c = report.chunks
    figure, (chunks_axes, nodes_axes) = new_figure(2, (10.0, 4.0))
    names = ["complete", "partial", "absent"]
    values = [c.complete, c.partial, c.absent if report.absent_known else 0]
    bars = chunks_axes.bar(names, values, color=["tab:green", "tab:orange", "tab:gray"])
    if not report.absent_known:
        chunks_axes.text(
            bars[2].get_x() + bars[2].get_width() / 2, 0, "unknown\n(needs --run)", ha="center", va="bottom"
        )
    prefix = f" (prefix {report.cache_prefix!r})" if report.cache_prefix else ""
    chunks_axes.set_title(f"{c.total:,} chunks of {report.model!r}{prefix}")
    chunks_axes.set_ylabel("chunks")
    chunks_axes.grid(True, axis="y", alpha=0.3)
    labels = [node.segment or node.endpoint or "(not in memory)" for node in report.nodes]
    unit, scale = _unit(max((node.bytes for node in report.nodes), default=0))
    complete = [node.complete_bytes / scale for node in report.nodes]
    partial = [node.partial_bytes / scale for node in report.nodes]
    other = [(node.bytes - node.complete_bytes - node.partial_bytes) / scale for node in report.nodes]
    nodes_axes.bar(labels, complete, label="complete chunks", color="tab:green")
    nodes_axes.bar(labels, partial, bottom=complete, label="partial chunks", color="tab:orange")
    nodes_axes.bar(
        labels,
        other,
        bottom=[a + b for a, b in zip(complete, partial, strict=True)],
        label="unexpected",
        color="tab:purple",
    )
    nodes_axes.set_title(f"bytes per store node (partial/live {report.partial_ratio:.1%})")
    nodes_axes.set_ylabel(unit)
    nodes_axes.tick_params(axis="x", labelrotation=20)
    nodes_axes.grid(True, axis="y", alpha=0.3)
    nodes_axes.legend()
    return save_figure(figure, path)
