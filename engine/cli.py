"""The ``pdserve`` command line: one subcommand per role, flags named like vLLM's.

    pdserve node --model DIR --role both --port 8100      # an OpenAI-compatible engine node
    pdserve make-tiny-model DIR --arch llama              # random tiny model for tests
    pdserve download smollm2-135m-instruct                # the demo model, converted locally
    pdserve kvstore --port 5557                           # the standalone KV store daemon
    pdserve proxy --prefill URL --decode URL --model DIR  # the public router
    pdserve serve                                         # store + prefill + decode + proxy, one command

Each subcommand lives with its package and registers itself here (``register(subparsers)``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys


def _drop_repo_root_from_path() -> None:
    """``python -m pdserve...`` run from a source checkout puts the checkout on sys.path, where its
    generic folder names (kernels/, engine/) would shadow real packages: transformers probes for
    the hub package ``kernels``. pdserve itself is imported through its installed mapping."""
    root = os.path.abspath(sys.path[0] or os.getcwd()) if sys.path else ""
    if os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isdir(os.path.join(root, "kernels")):
        sys.path.pop(0)


_drop_repo_root_from_path()

from pdserve.engine import envs  # noqa: E402

_SUBCOMMAND_MODULES = (
    "pdserve.engine.node",
    "pdserve.engine.checkpoints.tiny_model",
    "pdserve.engine.checkpoints.download",
    "pdserve.kvstore.cli",
    "pdserve.proxy.cli",
    "pdserve.proxy.serve",
    "pdserve.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default=envs.PDSERVE_LOG_LEVEL,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)     # one line per health probe is noise
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
