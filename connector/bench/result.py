"""What a benchmark workload reports: rows of figures, ratios and the targets they meet.

Absolute times on these 2-core machines move by tens of percent from run to run,
so every workload measures its contenders side by side in one run (alternating
repetitions, medians) and states its targets as ratios between them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field


def default_out_dir() -> Path:
    """Where records and plots go unless told: the user's cache (``$XDG_CACHE_HOME``), never the working folder."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvpipe" / "bench"


class BenchOptions(BaseModel):
    """How hard to try: ``quick`` shrinks every workload to a smoke test (used by the tests)."""

    quick: bool = False
    repeats: int = Field(5, gt=0)
    out_dir: Path = Field(default_factory=default_out_dir)


class Target(BaseModel):
    """One goal: ``measured`` compared with ``goal`` (``>=`` when higher is better)."""

    name: str
    measured: float
    goal: float
    op: Literal[">=", "<="] = ">="

    @property
    def met(self) -> bool:
        return self.measured >= self.goal if self.op == ">=" else self.measured <= self.goal

    def line(self) -> str:
        verdict = "met" if self.met else "MISSED"
        return f"{self.name}: {_cell(self.measured)} (target {self.op} {_cell(self.goal)}) {verdict}"


class WorkloadResult(BaseModel):
    """One workload's figures: a table (``rows`` share ``columns``), targets and notes."""

    workload: str
    description: str
    columns: list[str]
    rows: list[dict[str, Any]]
    targets: list[Target] = []
    notes: list[str] = []
    plots: list[str] = []
    parameters: dict[str, Any] = {}

    @property
    def all_met(self) -> bool:
        return all(target.met for target in self.targets)

    def record(self) -> dict[str, Any]:
        """The JSON record: everything, with each target's verdict spelled out."""
        document = self.model_dump(mode="json")
        for target, dumped in zip(self.targets, document["targets"], strict=True):
            dumped["met"] = target.met
        return document

    def table(self) -> str:
        """A plain-text table, then targets and notes, as the console shows it."""
        cells = [[_cell(row.get(column, "")) for column in self.columns] for row in self.rows]
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)]
        lines = [f"== {self.workload}: {self.description}"]
        lines.append("  ".join(c.ljust(w) for c, w in zip(self.columns, widths, strict=True)))
        lines.extend("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells)
        lines.extend(f"  {target.line()}" for target in self.targets)
        lines.extend(f"  note: {note}" for note in self.notes)
        lines.extend(f"  plot: {plot}" for plot in self.plots)
        return "\n".join(lines)

    def markdown(self) -> str:
        """The same as a Markdown section, for BENCHMARKS.md."""
        lines = [f"### {self.workload}", "", self.description, ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "---|" * len(self.columns))
        for row in self.rows:
            lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in self.columns) + " |")
        lines.append("")
        lines.extend(f"- {target.line()}" for target in self.targets)
        lines.extend(f"- {note}" for note in self.notes)
        lines.extend(f"- plot: `{plot}`" for plot in self.plots)
        return "\n".join(lines) + "\n"

    def write(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{self.workload}.json"
        path.write_text(json.dumps(self.record(), indent=2) + "\n")
        return path


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def contest_result(
    *,
    workload: str,
    description: str,
    medians: dict[str, float],
    cores: dict[str, float],
    rate: tuple[str, float],
    baselines: Sequence[str],
    targets: Sequence[Target],
    options: BenchOptions,
    parameters: dict[str, Any],
) -> WorkloadResult:
    """The result of contenders timed side by side: a row each, a bar plot, the targets.

    ``rate`` is the column's name and the amount of work one round does (bytes in
    GB, requests, ...), divided by each contender's seconds; ``baselines`` get a
    "vs <name>" column each: how many times faster than that contender. ``cores``:
    each contender's median cores busy (:attr:`.timing.Timed.cores`), its own
    column (empty for a contender without one).
    """
    unit, amount = rate
    rates = {name: amount / seconds for name, seconds in medians.items()}
    rows: list[dict[str, Any]] = [
        {
            "contender": name,
            "seconds": seconds,
            **({"cores": cores[name]} if name in cores else {}),
            unit: rates[name],
            **{f"vs {baseline}": medians[baseline] / seconds for baseline in baselines},
        }
        for name, seconds in medians.items()
    ]
    from .plot import bar_plot  # matplotlib only when a workload really ran

    plot = bar_plot(
        options.out_dir / f"{workload}.png",
        f"{workload}: " + ", ".join(f"{name} {_cell(value)}" for name, value in rates.items()),
        f"{unit} (median round)",
        rates,
    )
    return WorkloadResult(
        workload=workload,
        description=description,
        columns=["contender", "seconds", "cores", unit, *(f"vs {baseline}" for baseline in baselines)],
        rows=rows,
        targets=list(targets),
        plots=[str(plot)],
        parameters=parameters,
    )
