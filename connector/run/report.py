"""Showing a run: a progress line on a terminal, a summary table at the end."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from .engine import EngineTotals


class ProgressLine:
    """``[#####.....]  120/300 requests  4,231 objects put`` redrawn in place, at most 10 times a second.

    Only on a terminal: piped output (a CI log, ``--json`` consumers) stays clean.
    """

    WIDTH = 30

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self._stream = stream
        self._enabled = stream.isatty()
        self._last = 0.0

    def __call__(self, totals: EngineTotals, requests: int) -> None:
        now = time.monotonic()
        if not self._enabled or (now - self._last < 0.1 and totals.requests_finished < requests):
            return
        self._last = now
        filled = self.WIDTH * totals.requests_finished // max(requests, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        put = totals.counts["put"]
        self._stream.write(
            f"\r[{bar}] {totals.requests_finished:>6}/{requests} requests  {put:,} objects put"
        )
        self._stream.flush()

    def close(self) -> None:
        if self._enabled and self._last:
            self._stream.write("\n")
            self._stream.flush()


def _rate_lines(report: dict[str, Any]) -> list[str]:
    """The pipeline's rate first, then the generator's share of the wall time, then the baselines if run.

    The headline leaves the generator's time out: it is the workload's, and a
    connector in a real engine never pays it (the model computes the KV).
    """
    elapsed, synthetic = report["elapsed_s"], report["synthetic_kv_s"]
    share = synthetic / elapsed if elapsed > 0 else 0.0
    written = report["synthetic_kv_bytes"]
    lines = [
        f"bytes put    {report['bytes_put']:,}: pipeline {report['pipeline_gbps']:.3f} GB/s "
        f"(bytes put / the {elapsed:.2f} s run less the generator's {synthetic:.2f} s of CPU)",
        f"generator    {synthetic:.2f} s (CPU) of the {elapsed:.2f} s run ({share:.0%}) writing {written:,} "
        f"bytes of synthetic KV ({written / synthetic / 1e9 if synthetic > 0 else 0.0:.2f} GB/s)",
    ]
    alone, raw, ratio = report["pipeline_alone"], report["raw_put"], report["pipeline_vs_raw_put"]
    if alone is not None and raw is not None:
        lines.append(
            f"baselines    pipeline alone {alone['gbps']:.3f} GB/s, raw puts of the same objects "
            f"{raw['gbps']:.3f} GB/s" + (f": pipeline {ratio:.2f}x raw" if ratio is not None else "")
        )
    return lines


def summary_table(report: dict[str, Any]) -> str:
    """The report as aligned text: headline figures, then one row per stage."""
    store, objects, chunks, check = report["store"], report["objects"], report["chunks"], report["verify"]
    semantics = "on" if store["group_semantics"] else "off"
    lines = [
        f"store        {store['kind']} (group ids {'supported' if store['group_ids_supported'] else 'unsupported'}, "
        f"group semantics {semantics})",
        f"requests     {report['requests']:,}",
        f"objects      {objects['considered']:,} considered: {objects['existing']:,} existing, "
        f"{objects['put']:,} put ({objects['unsealed']:,} unsealed), {objects['failed']:,} failed, "
        f"{objects['throttled']:,} throttled",
        *_rate_lines(report),
        f"chunks       {chunks['total']:,}: {chunks['complete']:,} complete, {chunks['partial']:,} partial, "
        f"{chunks['absent']:,} absent",
        f"verify       {check['checked']:,} read back: {check['mismatches']:,} mismatches, {check['missing']:,} missing",
        "",
        f"{'stage':<10} {'in':>8} {'out':>8} {'dropped':>8} {'errors':>7} {'p50 ms':>8} {'p99 ms':>8}",
    ]
    for name, stage in report["stages"].items():
        if stage["passes_through"]:
            lines.append(
                f"{name:<10} (passes through: it would forward every item unchanged, so it never ran)"
            )
            continue
        lines.append(
            f"{name:<10} {stage['in']:>8,} {stage['out']:>8,} {stage['dropped']:>8,} {stage['errors']:>7,} "
            f"{stage['p50_ms']:>8.3f} {stage['p99_ms']:>8.3f}"
            + ("  (fused: run inline by its producer)" if stage["fused"] else "")
        )
    return "\n".join(lines)
