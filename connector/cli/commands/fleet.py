"""``kvpipe fleet``: start a local fleet, print the URL clients use, stop it all on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kvpipe.connector.fleet.fleet import Contender, Fleet, FleetSpec
from kvpipe.connector.fleet.network import NetworkError, NetworkUnavailable
from kvpipe.connector.fleet.processes import ProcessError
from kvpipe.connector.fleet.replica import POLICIES
from kvpipe.connector.store.mooncake.master import MasterError
from kvpipe.pipeline.config import one_line

from ..flags import FlagError, from_flags
from ..usage import UsageError

#: how often the running fleet checks that its replicas still answer
WATCH_EVERY_S = 5.0


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "fleet", help="vllm serve replicas behind vLLM's router over one Mooncake store, until Ctrl-C"
    )
    parser.add_argument(
        "--replicas", type=int, help="vllm serve replicas serving whole requests (default 2; not with a split)"
    )
    parser.add_argument(
        "--prefill", type=int, default=0, help="prefill engines of a prefill/decode split (with --decode)"
    )
    parser.add_argument(
        "--decode",
        type=int,
        default=0,
        help="decode engines of a split: the router prefills on one engine and decodes on another, "
        "the KV cache passing through the store (docs/disaggregation.md)",
    )
    parser.add_argument(
        "--connector",
        choices=[c.value for c in Contender],
        default="kvpipe",
        help="what the replicas load: kvpipe, vLLM's MooncakeStoreConnector, or none (default kvpipe)",
    )
    parser.add_argument(
        "--policy", choices=POLICIES, default="round_robin", help="the router's (default round_robin)"
    )
    parser.add_argument(
        "--masters", type=int, default=1, help="1: one spawned master; 2+: HA masters on etcd (default 1)"
    )
    parser.add_argument("--store-nodes", type=int, default=1, help="kvpipe store processes (default 1)")
    parser.add_argument("--segment", default="512MB", help="memory per store node (default 512MB)")
    parser.add_argument("--copies", type=int, default=1, help="Mooncake replicas of each object (default 1)")
    parser.add_argument(
        "--network-namespaces",
        action="store_true",
        help="each replica and store node in a network namespace of its own (root; for partition drills)",
    )
    parser.add_argument(
        "--share-cores",
        action="store_true",
        help="every replica's engine threads on every core (vLLM's default); without it each gets its own",
    )
    parser.add_argument("--model", type=Path, help="a model folder with config.json (default: a tiny Llama)")
    parser.add_argument("--log-dir", type=Path, help="the processes' logs (default: a new temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the fleet as one JSON object")
    parser.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
    fields = {
        "replicas": args.replicas,
        "prefill": args.prefill,
        "decode": args.decode,
        "connector": args.connector,
        "policy": args.policy,
        "masters": args.masters,
        "store_nodes": args.store_nodes,
        "node_segment": args.segment,
        "copies": args.copies,
        "model": args.model,
        "log_dir": args.log_dir,
        "network_namespaces": args.network_namespaces,
        "bind_cores": not args.share_cores,
    }
    try:
        spec = from_flags(FleetSpec, fields, {"node_segment": "segment"})
    except FlagError as error:
        raise UsageError(str(error)) from None
    if spec.model is not None and not (spec.model / "config.json").is_file():
        raise UsageError(f"--model: {str(spec.model)!r} holds no config.json")
    print(f"kvpipe fleet: starting (logs in {spec.log_dir or 'a temporary folder'})", flush=True)
    try:
        with Fleet(spec) as fleet:
            described = describe(fleet)
            if args.json:
                print(json.dumps(described), flush=True)
            else:
                engines = (
                    f"{spec.prefill} prefill and {spec.decode} decode engines"
                    if spec.decode
                    else f"{spec.replicas} replicas"
                )
                print(
                    f"kvpipe fleet: {engines} ({spec.connector} connector) behind the router "
                    f"({spec.policy}{', prefill/decode' if spec.decode else ''}); store at {described['store']} "
                    f"(admin HTTP {', '.join(described['store_admin'])}); "
                    f"logs in {fleet.log_dir}\n"
                    f"  replicas: {' '.join(described['replicas'])}\n"
                    f"  clients use: {fleet.url}   (model {fleet.model})\n"
                    "stop with Ctrl-C or SIGTERM (every process it started stops)",
                    flush=True,
                )
            watch(fleet)
    except (ProcessError, MasterError, NetworkUnavailable, NetworkError) as error:
        if args.verbose:
            raise
        raise UsageError(one_line(str(error))) from None
    return 0


def describe(fleet: Fleet) -> dict[str, Any]:
    return {
        "url": fleet.url,
        "model": str(fleet.model),
        "replicas": [r.url for r in fleet.replicas],
        "prefill": [r.url for r in fleet.prefills] if fleet.spec.decode else [],
        "decode": [r.url for r in fleet.decoders],
        "store": fleet.store_address.master_address,
        "store_admin": fleet.master_metrics,
        "log_dir": str(fleet.log_dir),
    }


def watch(fleet: Fleet) -> None:
    """Until interrupted: say once when a replica stops answering, and when it answers again."""
    down: set[str] = set()
    while True:
        time.sleep(WATCH_EVERY_S)
        for served in fleet.replicas:
            healthy = served.healthy
            if not healthy and served.name not in down:
                down.add(served.name)
                print(f"kvpipe fleet: {served.name} ({served.url}) does not answer", flush=True)
            elif healthy and served.name in down:
                down.discard(served.name)
                print(f"kvpipe fleet: {served.name} answers again", flush=True)
