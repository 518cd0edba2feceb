"""``kvpipe inspect``: a live store's report on one model, from the master's admin HTTP (:mod:`..inspect`)."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvpipe.connector.run.config import RunConfig
from kvpipe.connector.store.configs import MooncakeStoreConfig
from kvpipe.connector.store.mooncake import MooncakeConfigError, MooncakeSettings
from kvpipe.connector.store.mooncake.local_admin import local_master_metadata
from kvpipe.connector.store.mooncake.master_address import MasterAddress, split_host_port
from kvpipe.pipeline.config import one_line
from kvpipe.stages import key_model_name

from ..flags import FlagError, from_flags
from ..usage import UsageError, check_file_to_write, flagged, load_run_config


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "inspect", help="a live store's report on one model: objects, bytes, chunks, store nodes"
    )
    where = parser.add_mutually_exclusive_group()
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
    parser.add_argument(
        "--metrics",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="the master's admin HTTP (its --metrics_port), which lists the keys; repeat for HA masters",
    )
    parser.add_argument(
        "--model", metavar="NAME", help="the model: its key part, the last path component of its name"
    )
    parser.add_argument("--cache-prefix", metavar="P", help="the deployment's cache prefix (default: none)")
    parser.add_argument(
        "--run",
        type=Path,
        metavar="CONFIG",
        help="a kvpipe run config: its workload says which chunks should be stored (absent ones are counted)",
    )
    parser.add_argument("--groups", type=int, metavar="N", help="store groups per chunk (default: as seen)")
    parser.add_argument("--tp-ranks", type=int, metavar="N", help="tp ranks per chunk (default: as seen)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--png", type=Path, metavar="PATH", help="also draw the report as a PNG")
    parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="S", help="per HTTP request and probe (default 5)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="read the model's objects with a Mooncake client and check each against its seal "
        "(needs --master with --metadata-server, or --config)",
    )
    parser.add_argument(
        "--sample", type=int, metavar="N", help="with --verify: read N objects drawn at random (default: all)"
    )
    parser.add_argument(
        "--repair",
        action="store_true",
        help="with --verify: remove every object and seal of each chunk found corrupt",
    )
    parser.add_argument(
        "--metadata-server",
        metavar="M",
        help="with --verify and --master: the store's metadata server ('P2PHANDSHAKE' or 'http://host:port/metadata')",
    )
    parser.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
    from ..inspect import (
        InspectError,
        ReportRequest,
        Scrub,
        build_report,
        check_master,
        locate_admin,
        render_table,
        replay_run,
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
        check_file_to_write("--png", args.png)
    run_config = flagged("--run", lambda: load_run_config(args.run, [])) if args.run is not None else None
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
        admin = locate_admin(metrics, address, args.timeout)
        expected_run = None if run_config is None else replay_run(run_config, args.run)
        with ExitStack() as stack:
            scrub = None
            if verified_store is not None:
                store = stack.enter_context(scrub_client(verified_store))
                scrub = Scrub(store, args.sample, args.repair, _scrub_progress)
            request = ReportRequest(
                model,
                cache_prefix or "",
                store_groups=args.groups,
                tp_ranks=args.tp_ranks,
                run=expected_run,
                master=None if address is None else address.text,
                probe_timeout_s=min(args.timeout, 0.5),
                scrub=scrub,
            )
            report = build_report(admin, request)
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
        config = flagged("--config", lambda: load_run_config(args.config, []))
        store = _running_store(config, "--config", args.config)
        return store.master, f"--config: {args.config}: store.master", store
    if run_config is not None and isinstance(run_config.store, MooncakeStoreConfig):
        if run_config.store.master != "spawn":
            return run_config.store.master, f"--run: {args.run}: store.master", run_config.store
    return None, "--master", None


def _verified_store(args: argparse.Namespace, named: MooncakeStoreConfig | None) -> MooncakeStoreConfig:
    """The store --verify reads: --master's with --metadata-server, else the one --config or --run names."""
    if args.master is not None:
        metadata_server = args.metadata_server or _local_metadata_server(str(args.master))
        if metadata_server is None:
            raise UsageError(
                "--metadata-server: is required with --verify and --master (no master on this machine "
                "serves it to read it from): the store's, 'P2PHANDSHAKE' or 'http://host:port/metadata'"
            )
        try:
            return from_flags(MooncakeStoreConfig, {"master": args.master, "metadata_server": metadata_server})
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


def _local_metadata_server(master: str) -> str | None:
    """The metadata server of ``master`` where it runs on this machine (its own flags); None elsewhere."""
    try:
        host, port = split_host_port(master)
    except ValueError:
        return None  # HA (etcd://...) or malformed: the address check names it
    return local_master_metadata(host, port)


def _scrub_progress(read: int, total: int) -> None:
    print(f"kvpipe inspect: verified {read:,} of {total:,} objects", file=sys.stderr, flush=True)


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
