"""``kvpipe run CONFIG``: the main job, a synthetic workload saved, read back and reported."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvpipe.connector.run.config import RunConfig
from kvpipe.connector.run.job import RunResult, run
from kvpipe.connector.run.report import ProgressLine, summary_table
from kvpipe.connector.store.configs import MooncakeStoreConfig
from kvpipe.connector.store.mooncake import MooncakeError, MooncakeStore
from kvpipe.connector.store.mooncake.master import MasterError
from kvpipe.connector.store.protocol import ForwardingStore, Store
from kvpipe.pipeline import BuildError
from kvpipe.pipeline.config import one_line

from ..usage import UsageError, check_file_to_write, load_run_config


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("run", help="save a synthetic KV workload, read it back, report")
    parser.add_argument("config", type=Path, help="the run's YAML file (see configs/)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a YAML value, e.g. model.layers=8",
    )
    parser.add_argument(
        "--baselines",
        action="store_true",
        help="after the run, time the pipeline alone and raw puts on its objects, taking turns "
        "(medians of 5 rounds; the store needs room for two more copies of what the run puts)",
    )
    parser.add_argument("--dump-objects", type=Path, metavar="FILE", help="write one JSON line per object")
    parser.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
    config = load_run_config(args.config, args.set)
    if args.dump_objects is not None:
        check_file_to_write("--dump-objects", args.dump_objects)
    progress = ProgressLine()
    try:
        result = run(config, on_progress=progress, baselines=args.baselines, on_open=_say_spawned_master)
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


def _say_spawned_master(store: Store) -> None:
    """On stderr, where a master the run spawned serves while the run lasts (its admin HTTP: ``kvpipe inspect --metrics``)."""
    while isinstance(store, ForwardingStore):  # a breaker, a meter
        store = store.inner
    spawned = store.spawned_master if isinstance(store, MooncakeStore) else None
    if spawned is None or spawned.endpoints is None:
        return
    endpoints = spawned.endpoints
    print(
        f"kvpipe run: a master serves the store at {endpoints.master_address} "
        f"(admin HTTP {endpoints.host}:{endpoints.metrics_port}) until the run ends",
        file=sys.stderr,
        flush=True,
    )


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
