"""The ``beluga`` command: one module per command group.

Every command exits 0 on success and non-zero with a one-line
``beluga: error: ...`` message that says what to do, never a traceback, for
any BelugaError or bad argument.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from beluga import __version__
from beluga.cli import bench, certify, chaos, demo, pool, proxy, serve
from beluga.errors import BelugaError

GROUPS = [pool, serve, demo, bench, certify, chaos, proxy]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="beluga", description="Beluga: a KVCache store on a CXL shared memory pool."
    )
    parser.add_argument("--version", action="version", version=f"beluga {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (BelugaError, ValueError) as e:
        print(f"beluga: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) and not isinstance(e, BelugaError) else 1
    except KeyboardInterrupt:
        print("beluga: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `beluga ... | head`: the reader left, which is fine
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep the interpreter's exit quiet
        return 0
