"""``beluga certify``: the lab certification suite's front door (see hwtests/).

One host::

    beluga certify --dax /dev/dax0.0 --dax /dev/dax1.0 --out report/
    beluga certify --numa 2 --out report/
    beluga certify --backend shm --quick --out report/     # CI, a laptop

Two hosts sharing a device (the cross-host coherence litmus)::

    hostA$ beluga certify --role observer --dax /dev/dax0.0 --out a/
    hostB$ beluga certify --role writer   --dax /dev/dax0.0 --out b/

The suite formats its own pool on the target and destroys it when done, so
point it at a device or path that holds nothing you need (``--force`` to
replace a pool that is there).  It exits 1 when the verdict fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import uuid

from beluga.bench import certify, crosshost, report
from beluga.cli.common import add_pool_args, pool_spec


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "certify",
        help="measure and check a CXL pool (or a stand-in); write a report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("what to certify (one of these)")
    g.add_argument(
        "--dax",
        action="append",
        default=[],
        metavar="DEV",
        help="a device-DAX device, /dev/daxX.Y[@OFFSET] (repeat: several, interleaved)",
    )
    g.add_argument("--numa", type=int, metavar="N", help="a NUMA node (CXL memory as RAM)")
    add_pool_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="where the report goes")
    p.add_argument("--quick", action="store_true", help="small sizes and short runs (CI)")
    p.add_argument("--threads", type=int, help="most bandwidth threads (default: this host's CPUs)")
    p.add_argument(
        "--sections",
        default=",".join(certify.SECTIONS),
        help=f"comma-separated subset of {','.join(certify.SECTIONS)}",
    )
    p.add_argument("--force", action="store_true", help="replace a pool already on the target")
    p.add_argument(
        "--role",
        choices=crosshost.ROLES,
        help="cross-host litmus only: this host observes or writes (run the other on the peer)",
    )
    p.add_argument(
        "--trials",
        type=int,
        help="litmus trials per pattern (in a --role run the observer's count rules)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="--role: seconds to wait for the other host (default 120)",
    )
    p.set_defaults(handler=run)


def target_spec(args: argparse.Namespace) -> str:
    """The spec to certify, from exactly one of --dax, --numa, --backend or --pool."""
    choices = {
        "--dax": bool(args.dax),
        "--numa": args.numa is not None,
        "--backend/--pool": bool(args.backend or args.pool),
    }
    given = [name for name, on in choices.items() if on]
    if len(given) != 1:
        raise ValueError(
            "say what to certify with exactly one of --dax DEV (repeatable), --numa N, "
            f"--backend shm, or --pool SPEC (got {', '.join(given) or 'none'})"
        )
    if args.dax:
        args.backend, args.device = ("dax" if len(args.dax) == 1 else "interleave"), args.dax
    elif args.numa is not None:
        args.backend, args.node = "numa", args.numa
    if args.backend in ("shm", "numa") and not args.path:
        args.path = f"/dev/shm/beluga-certify-{uuid.uuid4().hex[:8]}"  # a scratch pool
    return pool_spec(args)


def run(args: argparse.Namespace) -> int:
    spec = target_spec(args)
    settings = certify.Settings.make(args.quick, args.threads)
    if args.trials is not None:
        if args.trials < 1:
            raise ValueError(f"--trials must be at least 1, not {args.trials}")
        settings = dataclasses.replace(settings, litmus_trials=args.trials)

    def log(line: str) -> None:
        print(f"certify: {line}", file=sys.stderr, flush=True)

    if args.role:
        doc = crosshost.run_role(
            spec, args.role, settings, force=args.force, timeout=args.timeout, log=log
        )
    else:
        sections = [s.strip() for s in args.sections.split(",") if s.strip()]
        doc = certify.run_suite(spec, settings, sections, force=args.force, log=log)
    paths = report.write_report(doc, args.out)
    print(f"wrote {', '.join(os.path.basename(p) for p in paths)} to {args.out}")
    for problem in doc["verdict"]["problems"]:
        print(f"certify: FAIL: {problem}", file=sys.stderr)
    return 0 if doc["verdict"]["ok"] else 1
