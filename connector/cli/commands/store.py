"""``kvpipe store``: a store node, lending the store a segment (and a disk tier) until SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import yaml

from kvpipe.connector.store.mooncake import MooncakeError, MooncakeSettings
from kvpipe.connector.store.mooncake.master import MasterError
from kvpipe.connector.store.mooncake.master_address import split_host_port
from kvpipe.connector.store.mooncake.settings import DiskTier
from kvpipe.pipeline.config import one_line

from ..flags import FlagError, from_flags
from ..usage import UsageError


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "store", help="a store node: lend the store a segment until SIGTERM (engines then mount none)"
    )
    parser.add_argument(
        "--master",
        default="spawn",
        help="'spawn' (a local master), 'host:port' or an HA cluster 'etcd://h1:p1;h2:p2' (default: spawn)",
    )
    parser.add_argument(
        "--metadata-server", help="with an existing master: 'P2PHANDSHAKE' or 'http://host:port/metadata'"
    )
    parser.add_argument("--segment", default="1GB", help="memory lent to the store (default: 1GB)")
    parser.add_argument(
        "--disk",
        type=Path,
        metavar="DIR",
        help="a folder (created if missing) for a disk tier behind the segment: what the master evicts "
        "from memory goes there (needs --disk-size; an existing master needs --enable_offload=true)",
    )
    parser.add_argument("--disk-size", metavar="SIZE", help="with --disk: the most it holds, e.g. 64GB")
    parser.add_argument(
        "--disk-read-buffer",
        metavar="SIZE",
        help="with --disk: memory disk reads are staged in; one load larger fails (default: 256MB)",
    )
    parser.add_argument("--protocol", default="tcp", help="transfer protocol (default: tcp)")
    parser.add_argument("--device-name", default="", help="RDMA device(s) for --protocol rdma")
    parser.add_argument(
        "--local-hostname", default="127.0.0.1", help="this machine's address as engines reach it"
    )
    parser.add_argument(
        "--master-metrics",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a master's metrics endpoint, to report the segment's use (a spawned master's is known)",
    )
    parser.add_argument("--report-every", type=float, default=10.0, metavar="S", help="seconds (default 10)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    parser.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
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
        # the admin HTTP is where kvpipe inspect lists the keys (--metrics)
        admin = f" (admin HTTP {', '.join(node.master_metrics)})" if node.master_metrics else ""
        print(
            f"kvpipe store: segment {node.segment_name} ({node.segment_bytes / (1 << 20):g} MiB){disk} "
            f"serves the store at {node.master}{admin}\n"
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


def _indented(text: str, prefix: str = "  ") -> str:
    return "".join(prefix + line for line in text.splitlines(keepends=True))
