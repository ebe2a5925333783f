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

from beluga.chaos.config import ChaosConfig
from beluga.cli.common import ConfigFlag, add_config_flags, config_from_args
from beluga.signals import interrupt_on_signals
from beluga.units import parse_size

#: the flags that set a ChaosConfig field of the round (defaults: the config's, --faults aside)
ROUND_FLAGS = (
    ConfigFlag("faults", "faults to inject (default {default})", default=1000),
    ConfigFlag("seed", "replay a run's faults (default: a fresh seed)", type=int),
    ConfigFlag(
        "coherence",
        "clients' coherence: native, mixed (every odd role slot under the non-coherent "
        "model), model (every role and the server) (default {default})",
        choices=["native", "mixed", "model"],
    ),
    ConfigFlag("writers", "out-of-place writers (default {default})"),
    ConfigFlag("inplace_writers", "in-place writers (default {default})"),
    ConfigFlag("readers", "readers (default {default})"),
    ConfigFlag("write_lease_s", "server write lease in s (default {default})", "--write-lease"),
    ConfigFlag("fault_interval_s", "mean seconds between faults (default {default})", "--interval"),
    ConfigFlag(
        "hang_bound_s",
        "seconds without progress that make a hang (default {default})",
        "--hang-bound",
    ),
)
#: the flags that set a ChaosConfig field of the setup: the scratch pool and the standbys
SETUP_FLAGS = (
    ConfigFlag(
        "pool_bytes",
        f"scratch pool size (default {ChaosConfig.pool_bytes >> 20}M)",
        "--pool-size",
        type=parse_size,
    ),
    ConfigFlag(
        "pool_path",
        "make the scratch pool here (must not exist; removed afterwards; "
        "default: a fresh /dev/shm/beluga-chaos-* file)",
        "--pool",
        metavar="PATH",
    ),
    ConfigFlag(
        "standbys",
        "run N 'beluga serve --standby' processes beside the server: a killed server "
        "is replaced by a standby's takeover, not a restart (default {default})",
        "--standby",
        metavar="N",
    ),
    ConfigFlag(
        "takeover_after_s",
        "the standbys' --takeover-after: a server stalled this long is fenced and "
        "replaced (stall_server faults; default {default:g})",
        "--takeover-after",
        metavar="S",
    ),
    ConfigFlag(
        "emulated_hosts",
        "with --standby: run each server and standby as a host of its own, so a "
        "standby sees a server only by its heartbeat and fences it with a --fence command, "
        "as across machines",
    ),
)


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "chaos",
        help="fault injection: kill, stop and corrupt a live pool while checking every read",
        description="Kill, stop and corrupt a scratch pool's server, writers and readers while "
        "checking every byte read against what was acknowledged.  Exits 1 when a promise "
        "broke; the seed printed first replays the run's faults (--seed N).",
    )
    add_config_flags(c, ChaosConfig, ROUND_FLAGS)
    c.add_argument(
        "--only",
        help="comma-separated fault kinds to inject (default: all; see beluga.chaos.KINDS)",
    )
    add_config_flags(c, ChaosConfig, SETUP_FLAGS)
    c.add_argument("--json", metavar="FILE", help="write the full report (JSON) to FILE")
    c.set_defaults(handler=run_chaos_command)


def run_chaos_command(args: argparse.Namespace) -> int:
    import beluga.compat.mooncake.chaos  # noqa: F401  (registers the Mooncake drop-in as a writer client)
    from beluga.chaos import KINDS, ChaosConfig, run_chaos
    from beluga.chaos.config import WEIGHTS

    weights = dict(WEIGHTS)
    if args.only:
        chosen = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = sorted(set(chosen) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
        weights = {k: v for k, v in weights.items() if k in chosen}
    config = config_from_args(
        ChaosConfig,
        args,
        ROUND_FLAGS + SETUP_FLAGS,
        weights=weights,
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
