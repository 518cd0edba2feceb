"""The ``kvpipe`` command line.

``kvpipe run CONFIG [--json] [--set dotted.path=value ...] [--baselines] [--dump-objects FILE]``
``kvpipe bench [WORKLOAD ...] [--quick] [--repeats N] [--out DIR] [--json] [--markdown FILE]``
``kvpipe store [--master ADDRESS|spawn] [--segment SIZE] [--master-metrics HOST:PORT ...] [--json]
[--disk DIR --disk-size SIZE [--disk-read-buffer SIZE]]``
``kvpipe inspect [--master ADDRESS | --config FILE] [--metrics HOST:PORT ...] [--model NAME]
[--cache-prefix P] [--run CONFIG] [--groups N] [--tp-ranks N] [--json] [--png PATH]
[--verify [--sample N] [--repair] [--metadata-server M]]``
``kvpipe fleet [--replicas N] [--connector kvpipe|vllm|none] [--policy P] [--masters N] [--store-nodes N]
[--segment SIZE] [--copies N] [--model DIR] [--log-dir DIR] [--json]``

Bad input (a missing file, malformed YAML, a wrong value, an unreachable master)
is one line on stderr naming the field and the value, and exit code 2: no
traceback, and nothing written.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NoReturn

import structlog
import yaml
from pydantic import ValidationError

from kvpipe.connector.store.configs import MooncakeStoreConfig, without_store_tag
from kvpipe.connector.store.mooncake import MooncakeConfigError, MooncakeError, MooncakeSettings
from kvpipe.connector.store.mooncake.master import MasterError, sigterm_unwinds
from kvpipe.connector.store.mooncake.master_address import MasterAddress, split_host_port
from kvpipe.connector.store.mooncake.settings import DiskTier
from kvpipe.pipeline import BuildError
from kvpipe.pipeline.config import describe_validation_error, load_yaml, one_line
from kvpipe.stages import key_model_name

from . import fleet
from .flags import FlagError, from_flags
from .run.config import RunConfig, apply_override
from .run.job import RunResult, run
from .run.report import ProgressLine, summary_table

USAGE_ERROR = 2


class UsageError(Exception):
    """Input the user can fix; shown as one line, exit code 2."""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        _configure_logging(args.verbose)
        with sigterm_unwinds():  # kvpipe store installs its own handler: it stops serving
            return args.command(args)
    except UsageError as error:
        print(f"kvpipe: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("kvpipe: interrupted; everything it started is stopped", file=sys.stderr)
        return 128 + signal.SIGINT


class _ArgumentParser(argparse.ArgumentParser):
    """Bad arguments as every other bad input: one line, exit code 2 (argparse adds its usage)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="kvpipe", description="Move LLM KV-cache blocks into Mooncake Store.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    run_parser = commands.add_parser("run", help="save a synthetic KV workload, read it back, report")
    run_parser.add_argument("config", type=Path, help="the run's YAML file (see configs/)")
    run_parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    run_parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a YAML value, e.g. model.layers=8",
    )
    run_parser.add_argument(
        "--baselines",
        action="store_true",
        help="after the run, time the pipeline alone and raw puts on its objects "
        "(the store needs room for another copy of what the run puts)",
    )
    run_parser.add_argument(
        "--dump-objects", type=Path, metavar="FILE", help="write one JSON line per object"
    )
    run_parser.set_defaults(command=_run_command)
    bench_parser = commands.add_parser("bench", help="the performance suite (see BENCHMARKS.md)")
    bench_parser.add_argument("workloads", nargs="*", metavar="WORKLOAD", help="default: all, in order")
    bench_parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not figures")
    bench_parser.add_argument("--repeats", type=int, default=5, help="rounds per contender (median)")
    bench_parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for JSON records and plots (default: $XDG_CACHE_HOME/kvpipe/bench, ~/.cache/kvpipe/bench)",
    )
    bench_parser.add_argument("--json", action="store_true", help="one JSON line per workload")
    bench_parser.add_argument(
        "--markdown", type=Path, metavar="FILE", help="also write the tables as Markdown (for BENCHMARKS.md)"
    )
    bench_parser.set_defaults(command=_bench_command)
    store_parser = commands.add_parser(
        "store", help="a store node: lend the store a segment until SIGTERM (engines then mount none)"
    )
    store_parser.add_argument(
        "--master",
        default="spawn",
        help="'spawn' (a local master), 'host:port' or an HA cluster 'etcd://h1:p1;h2:p2' (default: spawn)",
    )
    store_parser.add_argument(
        "--metadata-server", help="with an existing master: 'P2PHANDSHAKE' or 'http://host:port/metadata'"
    )
    store_parser.add_argument("--segment", default="1GB", help="memory lent to the store (default: 1GB)")
    store_parser.add_argument(
        "--disk",
        type=Path,
        metavar="DIR",
        help="a folder (created if missing) for a disk tier behind the segment: what the master evicts "
        "from memory goes there (needs --disk-size; an existing master needs --enable_offload=true)",
    )
    store_parser.add_argument("--disk-size", metavar="SIZE", help="with --disk: the most it holds, e.g. 64GB")
    store_parser.add_argument(
        "--disk-read-buffer",
        metavar="SIZE",
        help="with --disk: memory disk reads are staged in; one load larger fails (default: 256MB)",
    )
    store_parser.add_argument("--protocol", default="tcp", help="transfer protocol (default: tcp)")
    store_parser.add_argument("--device-name", default="", help="RDMA device(s) for --protocol rdma")
    store_parser.add_argument(
        "--local-hostname", default="127.0.0.1", help="this machine's address as engines reach it"
    )
    store_parser.add_argument(
        "--master-metrics",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a master's metrics endpoint, to report the segment's use (a spawned master's is known)",
    )
    store_parser.add_argument(
        "--report-every", type=float, default=10.0, metavar="S", help="seconds (default 10)"
    )
    store_parser.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    store_parser.set_defaults(command=_store_command)
    inspect_parser = commands.add_parser(
        "inspect", help="a live store's report on one model: objects, bytes, chunks, store nodes"
    )
    where = inspect_parser.add_mutually_exclusive_group()
    where.add_argument(
        "--master",
        metavar="ADDRESS",
        help="the master, 'host:port' or 'etcd://h1:p1;h2:p2': probed, and its host with port 9003 "
        "(Mooncake's default) is the default --metrics",
    )
    where.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="where the master is: a kvpipe run config (its store: section) or vLLM's Mooncake JSON (*.json)",
    )
    inspect_parser.add_argument(
        "--metrics",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="the master's admin HTTP (its --metrics_port), which lists the keys; repeat for HA masters",
    )
    inspect_parser.add_argument(
        "--model", metavar="NAME", help="the model: its key part, the last path component of its name"
    )
    inspect_parser.add_argument(
        "--cache-prefix", metavar="P", help="the deployment's cache prefix (default: none)"
    )
    inspect_parser.add_argument(
        "--run",
        type=Path,
        metavar="CONFIG",
        help="a kvpipe run config: its workload says which chunks should be stored (absent ones are counted)",
    )
    inspect_parser.add_argument(
        "--groups", type=int, metavar="N", help="store groups per chunk (default: as seen)"
    )
    inspect_parser.add_argument(
        "--tp-ranks", type=int, metavar="N", help="tp ranks per chunk (default: as seen)"
    )
    inspect_parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    inspect_parser.add_argument("--png", type=Path, metavar="PATH", help="also draw the report as a PNG")
    inspect_parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="S", help="per HTTP request and probe (default 5)"
    )
    inspect_parser.add_argument(
        "--verify",
        action="store_true",
        help="read the model's objects with a Mooncake client and check each against its seal "
        "(needs --master with --metadata-server, or --config)",
    )
    inspect_parser.add_argument(
        "--sample", type=int, metavar="N", help="with --verify: read N objects drawn at random (default: all)"
    )
    inspect_parser.add_argument(
        "--repair",
        action="store_true",
        help="with --verify: remove every object and seal of each chunk found corrupt",
    )
    inspect_parser.add_argument(
        "--metadata-server",
        metavar="M",
        help="with --verify and --master: the store's metadata server ('P2PHANDSHAKE' or 'http://host:port/metadata')",
    )
    inspect_parser.set_defaults(command=_inspect_command)
    fleet.add_parser(commands, UsageError)
    return parser


def _run_command(args: argparse.Namespace) -> int:
    config = load_run_config(args.config, args.set)
    if args.dump_objects is not None:
        _check_file_to_write("--dump-objects", args.dump_objects)
    progress = ProgressLine()
    try:
        result = run(config, on_progress=progress, baselines=args.baselines)
    except (MasterError, MooncakeError, BuildError, ValueError) as error:
        if args.verbose:  # -v: the whole story, traceback included
            raise
        field = _unreachable_store_field(config, error)
        message = one_line(str(error))
        raise UsageError(f"{field}: {message}" if field else message) from None
    finally:
        progress.close()
    if args.dump_objects is not None:
        _dump_objects(result, args.dump_objects)
    print(json.dumps(result.report) if args.json else summary_table(result.report))
    return 0


def _bench_command(args: argparse.Namespace) -> int:
    from kvpipe.connector.bench import WORKLOADS, BenchOptions
    from kvpipe.connector.bench.result import default_out_dir
    from kvpipe.connector.bench.suite import run_suite, unknown_workloads, write_markdown

    if unknown := unknown_workloads(args.workloads):
        raise UsageError(f"workload: unknown {unknown[0]!r}; choose from {', '.join(WORKLOADS)}")
    if args.repeats < 1:
        raise UsageError(f"--repeats: must be >= 1, got {args.repeats}")
    if args.out is None:
        args.out = default_out_dir()
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out: {str(args.out)!r} is a file, not a folder")
    if args.markdown is not None:
        _check_file_to_write("--markdown", args.markdown)
    options = BenchOptions(quick=args.quick, repeats=args.repeats, out_dir=args.out)
    results = run_suite(args.workloads, options, as_json=args.json)
    if args.markdown is not None:
        write_markdown(args.markdown, results, "kvpipe bench " + " ".join(sys.argv[2:]))
    print(f"kvpipe bench: records and plots in {args.out}", file=sys.stderr)
    missed = [target.name for result in results for target in result.targets if not target.met]
    if missed:
        print(f"kvpipe bench: {len(missed)} target(s) missed: {', '.join(missed)}", file=sys.stderr)
    return 0


def _store_command(args: argparse.Namespace) -> int:
    from kvpipe.connector.store.mooncake.store_node import NodeReady, SegmentUse, serve

    if args.report_every <= 0:
        raise UsageError(f"--report-every: must be > 0 seconds, got {args.report_every:g}")
    for address in args.master_metrics:
        try:
            split_host_port(address)
        except ValueError as error:
            raise UsageError(f"--master-metrics: {error}, got {address!r}") from None
    fields = {
        "master": args.master,
        "metadata_server": args.metadata_server,
        "global_segment_size": args.segment,
        "protocol": args.protocol,
        "device_name": args.device_name,
        "local_hostname": args.local_hostname,
    }
    try:
        fields["disk"] = _disk_tier(args)
        settings = from_flags(MooncakeSettings, fields, {"global_segment_size": "segment"})
    except FlagError as error:
        raise UsageError(str(error)) from None
    if settings.global_segment_size == 0:
        raise UsageError(
            f"--segment: a store node lends memory, so it must be at least 16 MiB, got {args.segment!r}"
        )
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}

    def ready(node: NodeReady) -> None:
        if args.json:
            print(json.dumps(node.as_json()), flush=True)
            return
        disk = "" if node.disk is None else f" and disk {node.disk.path} ({node.disk.size / (1 << 20):g} MiB)"
        print(
            f"kvpipe store: segment {node.segment_name} ({node.segment_bytes / (1 << 20):g} MiB){disk} "
            f"serves the store at {node.master}\n"
            "engines mount no segment of their own; kvpipe's store settings (YAML, or the connector's "
            f"extra config):\n{_indented(yaml.safe_dump({'store': node.kvpipe_store()}, sort_keys=False))}"
            f"vLLM's Mooncake JSON (MOONCAKE_CONFIG_PATH):\n  {json.dumps(node.vllm_config())}\n"
            "stop with SIGTERM or Ctrl-C (the segment's objects go with it)",
            flush=True,
        )

    def use(report: SegmentUse) -> None:
        if args.json:
            print(json.dumps(report.as_json()), flush=True)
            return
        share = report.used_bytes / report.capacity_bytes if report.capacity_bytes else 0.0
        print(
            f"kvpipe store: {report.used_bytes / (1 << 20):.1f} of "
            f"{report.capacity_bytes / (1 << 20):g} MiB used ({share:.1%})",
            flush=True,
        )

    try:
        closed = serve(settings, stop=stop, on_ready=ready, on_use=use, master_metrics=args.master_metrics,
                       report_every_s=args.report_every)  # fmt: skip
    except (MasterError, MooncakeError, ValueError) as error:
        if args.verbose:
            raise
        field = "--master" if isinstance(error, MasterError) and args.master != "spawn" else None
        message = one_line(str(error))
        raise UsageError(f"{field}: {message}" if field else message) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    done = "stopped" if closed else "stopped (the master drops the segment after its client TTL)"
    print(
        json.dumps({"event": "stopped", "closed": closed}) if args.json else f"kvpipe store: {done}",
        flush=True,
    )
    if not closed:
        os._exit(0)  # the native close still runs: exiting under it would crash at interpreter exit
    return 0


def _disk_tier(args: argparse.Namespace) -> DiskTier | None:
    """``kvpipe store``'s disk tier from ``--disk``, ``--disk-size`` and ``--disk-read-buffer``.

    :raises FlagError: one given without the others it needs, or a value the tier refuses.
    """
    if args.disk is None:
        given = "--disk-size" if args.disk_size is not None else "--disk-read-buffer"
        if args.disk_size is not None or args.disk_read_buffer is not None:
            raise FlagError(f"{given}: needs --disk DIR, the folder of the disk tier")
        return None
    if args.disk_size is None:
        raise FlagError(
            f"--disk: needs --disk-size SIZE, the most the disk tier holds, got --disk {args.disk}"
        )
    fields = {"path": args.disk, "size": args.disk_size, "read_buffer": args.disk_read_buffer}
    renames = {"path": "disk", "size": "disk_size", "read_buffer": "disk_read_buffer"}
    return from_flags(DiskTier, fields, renames)


def _inspect_command(args: argparse.Namespace) -> int:
    from .inspect import (
        InspectError,
        Scrub,
        admin_of_master,
        build_report,
        check_master,
        expected_objects,
        find_admin,
        render_table,
        scrub_client,
        write_png,
    )

    if args.timeout <= 0:
        raise UsageError(f"--timeout: must be > 0 seconds, got {args.timeout:g}")
    for flag, value in (("--groups", args.groups), ("--tp-ranks", args.tp_ranks)):
        if value is not None and value < 1:
            raise UsageError(f"{flag}: must be >= 1, got {value}")
        if value is not None and args.run is not None:
            raise UsageError(
                f"{flag}: not with --run (the run config says which shards each chunk has), got {value}"
            )
    verify_only = (
        ("--sample", args.sample),
        ("--repair", args.repair or None),
        ("--metadata-server", args.metadata_server),
    )
    for flag, value in verify_only:
        if value is not None and not args.verify:
            shown = "" if value is True else f", got {value!r}"
            raise UsageError(f"{flag}: only with --verify (inspect reads objects only to verify them){shown}")
    if args.sample is not None and args.sample < 1:
        raise UsageError(f"--sample: must be >= 1, got {args.sample}")
    if args.model is not None and "@" in key_model_name(args.model):
        raise UsageError(
            f"--model: must hold no '@' (vLLM's key format cannot tell it from a cache prefix), got {args.model!r}"
        )
    metrics = []
    for address in args.metrics:
        try:
            metrics.append(split_host_port(address))
        except ValueError as error:
            raise UsageError(f"--metrics: {error}, got {address!r}") from None
    if args.png is not None:
        _check_file_to_write("--png", args.png)
    run_config = _flagged("--run", lambda: load_run_config(args.run, [])) if args.run is not None else None
    model, cache_prefix = args.model, args.cache_prefix
    if run_config is not None:
        model, cache_prefix = _model_of_run(run_config, args)
    if model is None:
        raise UsageError(
            "--model: is required (the model's key part, e.g. Llama-3.1-8B), or give --run CONFIG"
        )

    master, master_field, named_store = _inspected_master(args, run_config)
    try:
        address = MasterAddress.parse(master) if master is not None else None
    except ValueError as error:
        raise UsageError(f"{master_field}: {error}, got {master!r}") from None
    verified_store = _verified_store(args, named_store) if args.verify else None
    try:
        if address is not None:
            check_master(address, args.timeout)
        if not metrics and address is None:
            raise InspectError(
                "metrics", "is required: the master's admin HTTP (its --metrics_port), or --master/--config"
            )
        derived = not metrics
        try:
            admin = find_admin(metrics or [admin_of_master(address, args.timeout)], args.timeout)  # type: ignore[arg-type]
        except InspectError as error:
            if not derived:
                raise
            raise InspectError(
                "metrics",
                f"not given, and {error} (Mooncake's default --metrics_port): pass --metrics HOST:PORT",
            ) from None
        expected = None
        if run_config is not None:
            try:
                expected = expected_objects(run_config)
            except ValueError as error:
                raise InspectError("run", f"{args.run}: {one_line(str(error))}") from None
        with ExitStack() as stack:
            scrub = None
            if verified_store is not None:
                store = stack.enter_context(scrub_client(verified_store))
                scrub = Scrub(store, args.sample, args.repair, _scrub_progress)
            report = build_report(
                admin,
                model,
                cache_prefix or "",
                store_groups=args.groups,
                tp_ranks=args.tp_ranks,
                expected=expected,
                run_config=None if args.run is None else str(args.run),
                run_requests_group_ids=None
                if run_config is None
                else bool(run_config.save.enable_group_semantics),
                master=None if address is None else address.text,
                probe_timeout_s=min(args.timeout, 0.5),
                scrub=scrub,
            )
    except InspectError as error:
        if args.verbose:
            raise
        field = master_field if error.field == "master" else f"--{error.field.replace('_', '-')}"
        raise UsageError(f"{field}: {one_line(str(error))}") from None
    print(json.dumps(report.as_json()) if args.json else render_table(report))
    if args.png is not None:
        write_png(report, args.png)
        print(f"kvpipe inspect: figure in {args.png}", file=sys.stderr)
    return 0


def _model_of_run(config: RunConfig, args: argparse.Namespace) -> tuple[str, str]:
    """The run's model and cache prefix; UsageError when --model or --cache-prefix says otherwise."""
    model, cache_prefix = key_model_name(config.model.name), config.save.cache_prefix
    if args.model is not None and key_model_name(args.model) != model:
        raise UsageError(f"--model: {args.model!r} is not the model of --run {args.run} ({model!r})")
    if args.cache_prefix is not None and args.cache_prefix != cache_prefix:
        raise UsageError(
            f"--cache-prefix: {args.cache_prefix!r} is not the cache prefix of --run {args.run} ({cache_prefix!r})"
        )
    return model, cache_prefix


def _inspected_master(
    args: argparse.Namespace, run_config: RunConfig | None
) -> tuple[str | None, str, MooncakeStoreConfig | None]:
    """The master's address (--master, else --config's, else --run's store if it names a running
    master), where it was given, for errors (``--master`` or ``--config: FILE: field``), and the
    store's client settings where that source has them (not --master's)."""
    if args.master is not None:
        return str(args.master), "--master", None
    if args.config is not None:
        if args.config.suffix.lower() == ".json":
            try:
                settings = MooncakeSettings.from_vllm_file(args.config)
            except MooncakeConfigError as error:
                raise UsageError(f"--config: {one_line(str(error))}") from None
            store = MooncakeStoreConfig.model_validate(settings.model_dump())
            return settings.master, f"--config: {args.config}: master_server_address", store
        config = _flagged("--config", lambda: load_run_config(args.config, []))
        store = _running_store(config, "--config", args.config)
        return store.master, f"--config: {args.config}: store.master", store
    if run_config is not None and isinstance(run_config.store, MooncakeStoreConfig):
        if run_config.store.master != "spawn":
            return run_config.store.master, f"--run: {args.run}: store.master", run_config.store
    return None, "--master", None


def _verified_store(args: argparse.Namespace, named: MooncakeStoreConfig | None) -> MooncakeStoreConfig:
    """The store --verify reads: --master's with --metadata-server, else the one --config or --run names."""
    if args.master is not None:
        if args.metadata_server is None:
            raise UsageError(
                "--metadata-server: is required with --verify and --master: the store's, "
                "'P2PHANDSHAKE' or 'http://host:port/metadata'"
            )
        try:
            return from_flags(MooncakeStoreConfig, {"master": args.master, "metadata_server": args.metadata_server})
        except FlagError as error:
            raise UsageError(str(error)) from None
    if args.metadata_server is not None:
        raise UsageError(
            f"--metadata-server: only with --master (the config names the store's), got {args.metadata_server!r}"
        )
    if named is None:
        raise UsageError(
            "--verify: needs the store's client settings: give --master ADDRESS with --metadata-server M, "
            "or --config FILE"
        )
    return named


def _scrub_progress(read: int, total: int) -> None:
    print(f"kvpipe inspect: verified {read:,} of {total:,} objects", file=sys.stderr, flush=True)


def _flagged(flag: str, load: Callable[[], RunConfig]) -> RunConfig:
    """``load()``, its UsageError prefixed with the flag that named the file."""
    try:
        return load()
    except UsageError as error:
        raise UsageError(f"{flag}: {error}") from None


def _running_store(config: RunConfig, flag: str, path: Path) -> MooncakeStoreConfig:
    """The run config's store; UsageError unless it is a running Mooncake master's."""
    store = config.store
    if not isinstance(store, MooncakeStoreConfig):
        raise UsageError(
            f"{flag}: {path}: store.kind: must be 'mooncake' to name a running store, got {store.kind!r}"
        )
    if store.master == "spawn":
        raise UsageError(f"{flag}: {path}: store.master: 'spawn' names no running master; give its address")
    return store


def _indented(text: str, prefix: str = "  ") -> str:
    return "".join(prefix + line for line in text.splitlines(keepends=True))


def load_run_config(path: Path, overrides: Sequence[str]) -> RunConfig:
    """The validated config: the file, then each ``--set``; UsageError naming the place otherwise."""
    try:
        document = load_yaml(path) or {}
    except BuildError as error:
        raise UsageError(str(error)) from None
    if not isinstance(document, dict):
        kind = type(document).__name__
        raise UsageError(f"{path}: must be a mapping of sections (store, model, workload, ...), got a {kind}")
    for assignment in overrides:
        try:
            apply_override(document, assignment)
        except ValueError as error:
            raise UsageError(str(error)) from None
    try:
        return RunConfig.model_validate(document)
    except ValidationError as error:
        raise UsageError(
            f"{path}: {one_line(describe_validation_error(error, '', without_store_tag))}"
        ) from None


def _check_file_to_write(flag: str, path: Path) -> None:
    """Refuse, before any work, a file that could not be written after it."""
    if path.is_dir():
        raise UsageError(f"{flag}: {str(path)!r} is a folder, not a file")
    if not path.parent.is_dir():
        raise UsageError(f"{flag}: folder {str(path.parent)!r} does not exist")


def _unreachable_store_field(config: RunConfig, error: Exception) -> str | None:
    """``store.master`` or ``store.metadata_server`` when a configured endpoint did not answer.

    (A spawned master's endpoints are kvpipe's own, so its failures name no field.)
    """
    store = config.store
    configured = isinstance(store, MooncakeStoreConfig) and store.master != "spawn"
    if not configured or not isinstance(error, MasterError):
        return None
    return "store.metadata_server" if "metadata server" in str(error) else "store.master"


def _dump_objects(result: RunResult, path: Path) -> None:
    with path.open("w") as out:
        for record, status in result.objects.values():
            line: dict[str, Any] = {
                "key": record.key,
                "group_id": record.group_id,
                "size": record.size,
                "status": status.value,
            }
            out.write(json.dumps(line) + "\n")


def _configure_logging(verbosity: int) -> None:
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbosity, 2)]
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # sys.stderr looked up per logger: tests and embedders may swap it.
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
    )


if __name__ == "__main__":
    sys.exit(main())
