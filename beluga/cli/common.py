"""Options shared by command groups: which pool, how big, JSON output."""

from __future__ import annotations

import argparse

from beluga.pool import DEFAULT_POOL, POOL_ENV, resolve_pool
from beluga.units import parse_size


def add_pool_args(parser: argparse.ArgumentParser) -> None:
    """--pool SPEC, or its pieces: --backend with --path/--node/--device (--path alone: shm)."""
    g = parser.add_argument_group("pool location")
    g.add_argument(
        "--pool",
        metavar="SPEC",
        help="pool spec, e.g. shm:/dev/shm/beluga, numa:1:/dev/shm/b, dax:/dev/dax0.0, "
        "interleave:2097152:dax:/dev/dax0.0,dax:/dev/dax1.0 "
        f"(default: ${POOL_ENV} or {DEFAULT_POOL})",
    )
    g.add_argument(
        "--backend",
        choices=["shm", "numa", "dax", "interleave"],
        help="build the spec from parts instead of --pool",
    )
    g.add_argument(
        "--path", help="shm/numa: the backing file (alone: --backend shm with this file)"
    )
    g.add_argument("--node", type=int, help="numa: the NUMA node to bind to")
    g.add_argument(
        "--device",
        action="append",
        default=[],
        help="dax/interleave: a /dev/daxX.Y device (repeat to interleave)",
    )
    g.add_argument(
        "--data-offset",
        type=parse_size,
        default=0,
        help="dax: start this far into the device (2 MiB multiple)",
    )
    g.add_argument(
        "--stripe",
        type=parse_size,
        default=2 << 20,
        help="interleave: stripe size (2 MiB multiple; default 2M)",
    )


def pool_spec(args: argparse.Namespace, default: str | None = DEFAULT_POOL) -> str:
    """The spec named by --pool or built from --backend and its parts (see resolve_pool).

    Raises:
        PoolNotNamedError: nothing names a pool and ``default`` is None.
    """
    backend = args.backend or ("shm" if args.path else None)  # --path alone: an shm pool
    if args.pool and backend:
        raise ValueError("give either --pool SPEC or --backend/--path with its options, not both")
    if not backend:
        if args.node is not None or args.device:
            raise ValueError("--node and --device need --backend numa, dax or interleave")
        return resolve_pool(args.pool, setting="--pool", default=default)
    path = args.path or "/dev/shm/beluga"
    if backend == "shm":
        return f"shm:{path}"
    if backend == "numa":
        if args.node is None:
            raise ValueError("--backend numa needs --node N (see 'beluga pool nodes')")
        return f"numa:{args.node}:{path}"
    if not args.device:
        raise ValueError(f"--backend {backend} needs --device /dev/daxX.Y")
    offset = f"@{args.data_offset}" if args.data_offset else ""
    devices = [f"dax:{d}{offset}" for d in args.device]
    if backend == "dax":
        if len(devices) > 1:
            raise ValueError("--backend dax takes one --device; use --backend interleave for more")
        return devices[0]
    return f"interleave:{args.stripe}:{','.join(devices)}"


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="print (or write to FILE) a JSON document of named figures",
    )
