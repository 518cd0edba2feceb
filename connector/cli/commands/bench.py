"""``kvpipe bench``: the performance suite (:mod:`kvpipe.connector.bench`), its options checked first."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..usage import UsageError, check_file_to_write


def add_parser(commands: Any) -> None:
    from kvpipe.connector.bench import WORKLOADS  # names only: no workload module is imported

    parser = commands.add_parser(
        "bench",
        help="the performance suite (see BENCHMARKS.md)",
        description="The performance suite: each workload times its contenders side by side and checks "
        "its targets. BENCHMARKS.md says what each workload measures, how long it takes and how to read it.",
    )
    parser.add_argument(
        "workloads",
        nargs="*",
        metavar="WORKLOAD",
        help=f"one or more of: {', '.join(WORKLOADS)} (default: all, in this order)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not figures")
    parser.add_argument(
        "--pd",
        action="store_true",
        help="serve as a prefill/decode split: runs serve-pd in serve's place (docs/disaggregation.md)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds per contender (median)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for JSON records and plots (default: $XDG_CACHE_HOME/kvpipe/bench, ~/.cache/kvpipe/bench)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON line per workload")
    parser.add_argument(
        "--markdown", type=Path, metavar="FILE", help="also write the tables as Markdown (for BENCHMARKS.md)"
    )
    parser.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
    from kvpipe.connector.bench import WORKLOADS, BenchOptions
    from kvpipe.connector.bench.result import default_out_dir
    from kvpipe.connector.bench.suite import run_suite, unknown_workloads, write_markdown

    if args.pd:
        if "serve" not in args.workloads:
            raise UsageError(f"--pd: a variant of the serve workload, got workloads {args.workloads or 'all'}")
        args.workloads = ["serve-pd" if name == "serve" else name for name in args.workloads]
    if unknown := unknown_workloads(args.workloads):
        raise UsageError(f"workload: unknown {unknown[0]!r}; choose from {', '.join(WORKLOADS)}")
    if args.repeats < 1:
        raise UsageError(f"--repeats: must be >= 1, got {args.repeats}")
    if args.out is None:
        args.out = default_out_dir()
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out: {str(args.out)!r} is a file, not a folder")
    if args.markdown is not None:
        check_file_to_write("--markdown", args.markdown)
    options = BenchOptions(quick=args.quick, repeats=args.repeats, out_dir=args.out)
    results = run_suite(args.workloads, options, as_json=args.json)
    if args.markdown is not None:
        write_markdown(args.markdown, results, "kvpipe bench " + " ".join(sys.argv[2:]))
    print(f"kvpipe bench: records and plots in {args.out}", file=sys.stderr)
    missed = [target.name for result in results for target in result.targets if not target.met]
    if missed:
        print(f"kvpipe bench: {len(missed)} target(s) missed: {', '.join(missed)}", file=sys.stderr)
    return 0
