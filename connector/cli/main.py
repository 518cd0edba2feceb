"""The ``kvpipe`` command line: the parser, the dispatch to a command, one-line errors.

``kvpipe run CONFIG [--json] [--set dotted.path=value ...] [--baselines] [--dump-objects FILE]``
``kvpipe bench [WORKLOAD ...] [--quick] [--pd] [--repeats N] [--out DIR] [--json] [--markdown FILE]``
``kvpipe store [--master ADDRESS|spawn] [--metadata-server M] [--segment SIZE] [--master-metrics HOST:PORT ...]
[--local-hostname H] [--protocol P] [--device-name D] [--report-every S] [--json]
[--disk DIR --disk-size SIZE [--disk-read-buffer SIZE]]``
``kvpipe inspect [--master ADDRESS | --config FILE] [--metrics HOST:PORT ...] [--model NAME]
[--cache-prefix P] [--run CONFIG] [--groups N] [--tp-ranks N] [--json] [--png PATH] [--timeout S]
[--verify [--sample N] [--repair] [--metadata-server M]]``
``kvpipe fleet [--replicas N | --prefill N --decode M] [--connector kvpipe|vllm|none] [--policy P]
[--masters N] [--store-nodes N] [--segment SIZE] [--copies N] [--network-namespaces] [--share-cores]
[--model DIR] [--log-dir DIR] [--json]``

``--help`` on each says the rest; docs/ names no flag the parser lacks (tests/docs checks it).

Each command is a module of :mod:`.commands` (its arguments and what it does).
Bad input (a missing file, malformed YAML, a wrong value, an unreachable master)
is one line on stderr naming the field and the value, and exit code 2: no
traceback, and nothing written.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

import structlog

from kvpipe.connector.store.mooncake.master import sigterm_unwinds

from .commands import COMMANDS
from .usage import USAGE_ERROR, UsageError


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        _configure_logging(args.verbose)
        with sigterm_unwinds():  # kvpipe store installs its own handler: it stops serving
            # set by the chosen subcommand's parser (set_defaults); a Namespace's attributes are untyped
            command: Callable[[argparse.Namespace], int] = args.command
            return command(args)
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


def parser() -> argparse.ArgumentParser:
    """The whole command line: each command's subparser (docs and tests read its flags from it)."""
    top = _ArgumentParser(prog="kvpipe", description="Move LLM KV-cache blocks into Mooncake Store.")
    top.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    commands = top.add_subparsers(required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return top


def _configure_logging(verbosity: int) -> None:
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbosity, 2)]
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # sys.stderr looked up per logger: tests and embedders may swap it.
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
    )


if __name__ == "__main__":
    sys.exit(main())
