"""``beluga chaos``: inject faults into a live pool and check every answer.

Makes a scratch pool, runs a metadata server, writers and readers in their
own processes, kills and stops them, writes hostile bytes into RPC slots,
block headers and payloads, and checks every value read against what was
acknowledged (see :mod:`beluga.chaos`).  Prints the seed first, a summary
last, and exits 1 when a promise was broken (wrong bytes, a lost
acknowledged write, an uncommitted value read, a hang), so a failing run
replays with ``beluga chaos --seed N``.
"""

from __future__ import annotations

import argparse
import json
import sys

from beluga.chaos.driver import ChaosConfig
from beluga.signals import interrupt_on_signals
from beluga.units import parse_size

_DEFAULT = ChaosConfig()  # one home for every default: the config's own


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "chaos",
        help="fault injection: kill, stop and corrupt a live pool while checking every read",
        description="Kill, stop and corrupt a scratch pool's server, writers and readers while "
        "checking every byte read against what was acknowledged.  Exits 1 when a promise "
        "broke; the seed printed first replays the run's faults (--seed N).",
    )
    c.add_argument("--faults", type=int, default=1000, help="faults to inject (default 1000)")
    c.add_argument("--seed", type=int, help="replay a run's faults (default: a fresh seed)")
    c.add_argument(
        "--coherence",
        choices=["native", "mixed", "model"],
        default="native",
        help="clients' coherence: native, mixed (every odd role slot under the non-coherent "
        "model), model (every role and the server) (default native)",
    )
    c.add_argument(
        "--writers",
        type=int,
        default=_DEFAULT.writers,
        help=f"out-of-place writers (default {_DEFAULT.writers})",
    )
    c.add_argument(
        "--inplace-writers",
        type=int,
        default=_DEFAULT.inplace_writers,
        help=f"in-place writers (default {_DEFAULT.inplace_writers})",
    )
    c.add_argument(
        "--readers",
        type=int,
        default=_DEFAULT.readers,
        help=f"readers (default {_DEFAULT.readers})",
    )
    c.add_argument(
        "--write-lease",
        type=float,
        default=_DEFAULT.write_lease_s,
        help=f"server write lease in s (default {_DEFAULT.write_lease_s})",
    )
    c.add_argument(
        "--interval",
        type=float,
        default=_DEFAULT.fault_interval_s,
        help=f"mean seconds between faults (default {_DEFAULT.fault_interval_s})",
    )
    c.add_argument(
        "--hang-bound",
        type=float,
        default=_DEFAULT.hang_bound_s,
        help=f"seconds without progress that make a hang (default {_DEFAULT.hang_bound_s})",
    )
    c.add_argument(
        "--only",
        help="comma-separated fault kinds to inject (default: all; see beluga.chaos.KINDS)",
    )
    c.add_argument(
        "--pool-size",
        type=parse_size,
        default=_DEFAULT.pool_bytes,
        help=f"scratch pool size (default {_DEFAULT.pool_bytes >> 20}M)",
    )
    c.add_argument(
        "--pool",
        metavar="PATH",
        help="make the scratch pool here (must not exist; removed afterwards; "
        "default: a fresh /dev/shm/beluga-chaos-* file)",
    )
    c.add_argument(
        "--standby",
        type=int,
        default=_DEFAULT.standbys,
        metavar="N",
        help="run N 'beluga serve --standby' processes beside the server: a killed server "
        "is replaced by a standby's takeover, not a restart (default 0)",
    )
    c.add_argument(
        "--takeover-after",
        type=float,
        default=_DEFAULT.takeover_after_s,
        metavar="S",
        help="the standbys' --takeover-after: a server stalled this long is fenced and "
        f"replaced (stall_server faults; default {_DEFAULT.takeover_after_s:g})",
    )
    c.add_argument(
        "--emulated-hosts",
        action="store_true",
        help="with --standby: run each server and standby as a host of its own, so a "
        "standby sees a server only by its heartbeat and fences it with a --fence command, "
        "as across machines",
    )
    c.add_argument("--json", metavar="FILE", help="write the full report (JSON) to FILE")
    c.set_defaults(handler=run_chaos_command)


def run_chaos_command(args: argparse.Namespace) -> int:
    import beluga.compat.mooncake.chaos  # noqa: F401  (registers the Mooncake drop-in as a writer client)
    from beluga.chaos import KINDS, ChaosConfig, run_chaos
    from beluga.chaos.driver import WEIGHTS

    weights = dict(WEIGHTS)
    if args.only:
        chosen = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = sorted(set(chosen) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
        weights = {k: v for k, v in weights.items() if k in chosen}
    config = ChaosConfig(
        faults=args.faults,
        seed=args.seed,
        coherence=args.coherence,
        writers=args.writers,
        inplace_writers=args.inplace_writers,
        readers=args.readers,
        write_lease_s=args.write_lease,
        fault_interval_s=args.interval,
        hang_bound_s=args.hang_bound,
        pool_bytes=args.pool_size,
        pool_path=args.pool,
        weights=weights,
        standbys=args.standby,
        takeover_after_s=args.takeover_after,
        emulated_hosts=args.emulated_hosts,
        writer_client="mooncake",
    )
    # SIGTERM ends the round as Ctrl-C would, from the driver's event loop, so it stops its
    # processes and removes its scratch pool (beluga.signals)
    with interrupt_on_signals():
        report = run_chaos(config)
    print(report.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
        print(f"report written to {args.json}", file=sys.stderr)
    return 0 if report.ok else 1
