"""``beluga serve`` (the metadata server) and ``beluga stats`` (its counters)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from beluga.cli.common import add_pool_args, pool_spec
from beluga.server import service
from beluga.server.recovery_state import RECOVERY_SHARE

CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="run the metadata server of a pool (until SIGTERM/SIGINT)")
    add_pool_args(s)
    s.add_argument(
        "--coherence",
        choices=["native", "model"],
        help="coherence mode (default: $BELUGA_COHERENCE or native)",
    )
    s.add_argument(
        "--write-lease",
        type=float,
        default=service.WRITE_LEASE_S,
        help="seconds a writer may hold an extent before commit (default %(default)g)",
    )
    s.add_argument(
        "--read-lease",
        type=float,
        default=service.READ_LEASE_S,
        help="seconds a lookup protects an extent from reuse (default %(default)g)",
    )
    s.add_argument(
        "--high-watermark",
        type=float,
        default=service.HIGH_WATERMARK,
        help="fraction of blocks in use above which LRU eviction starts (default %(default)g)",
    )
    s.add_argument(
        "--low-watermark",
        type=float,
        default=service.LOW_WATERMARK,
        help="fraction of blocks in use eviction brings it down to (default %(default)g)",
    )
    s.add_argument(
        "--recovery-share",
        type=float,
        default=RECOVERY_SHARE,
        metavar="SHARE",
        help="after a takeover, the share of a busy server's time its recovery takes, "
        "above 0 and below 1 (an idle server recovers flat out; default %(default)g)",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on http://ADDR:PORT/metrics (0: any free port)",
    )
    s.add_argument(
        "--metrics-addr",
        default="0.0.0.0",
        metavar="ADDR",
        help="address the metrics endpoint listens on (default %(default)s)",
    )
    s.add_argument(
        "--tier",
        metavar="SPEC",
        help="the cross-pod tier evicted blocks are demoted to: "
        "mooncake:METADATA_URL,MASTER_ADDRESS[,write-through] (default: $BELUGA_TIER, or none)",
    )
    s.add_argument(
        "--standby",
        action="store_true",
        help="wait while another server serves the pool, take its seat once it is gone or "
        "fenced (docs/operations.md), recover and serve",
    )
    s.add_argument(
        "--takeover-after",
        type=float,
        metavar="SECONDS",
        default=None,
        help="with --standby: how long the serving server's heartbeat may stand still before "
        "it is fenced and its seat taken (default 5); a server of this machine is SIGKILLed",
    )
    s.add_argument(
        "--fence",
        metavar="COMMAND",
        help="with --standby: a shell command that cuts a stalled server's host off the pool "
        "(exit 0: done), e.g. the switch's port unbind; it gets BELUGA_FENCE_PID, "
        "BELUGA_FENCE_BOOT_ID, BELUGA_FENCE_START_MS.  Without it, a server on another host "
        "is never taken over",
    )
    s.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="least severe log records printed on stderr (default %(default)s)",
    )
    s.set_defaults(handler=run_serve)

    t = sub.add_parser("stats", help="ask a pool's metadata server for its counters")
    add_pool_args(t)
    t.add_argument("--json", action="store_true", help="JSON instead of text (one line a refresh)")
    t.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server")
    t.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    t.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N refreshes")
    t.set_defaults(handler=run_stats)


class _ServeFormatter(logging.Formatter):
    """``beluga serve: message``; records above INFO name their level."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno > logging.INFO:
            return f"beluga serve: {record.levelname.lower()}: {message}"
        return f"beluga serve: {message}"


def _log_to_stderr(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ServeFormatter())
    logger = logging.getLogger("beluga")
    logger.addHandler(handler)
    logger.setLevel(level.upper())


def run_serve(args: argparse.Namespace) -> int:
    from beluga.server.server import serve
    from beluga.server.standby import TAKEOVER_AFTER_S

    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port {args.metrics_port} is not a TCP port (0..65535)")
    if not args.standby and (args.takeover_after is not None or args.fence is not None):
        raise ValueError("--takeover-after and --fence are for a standby: add --standby")
    if not 0 < args.recovery_share < 1:
        raise ValueError(f"--recovery-share {args.recovery_share:g}: must be above 0 and below 1")
    takeover_after = TAKEOVER_AFTER_S if args.takeover_after is None else args.takeover_after
    if takeover_after <= 0:
        raise ValueError(f"--takeover-after {takeover_after:g}: must be above 0 seconds")
    _log_to_stderr(args.log_level)
    serve(
        pool_spec(args),
        coherence=args.coherence,
        write_lease_s=args.write_lease,
        read_lease_s=args.read_lease,
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        recovery_share=args.recovery_share,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        tier=args.tier,
        standby=args.standby,
        takeover_after=takeover_after,
        fence_command=args.fence,
    )
    return 0


def _print_stats(stats: dict[str, Any], as_json: bool, indent: int | None) -> None:
    if as_json:
        print(json.dumps(stats, indent=indent))
    else:
        for key, value in stats.items():
            print(f"{key:>22}: {value}")
    sys.stdout.flush()


def run_stats(args: argparse.Namespace) -> int:
    from beluga.kv.store import KVStore

    if args.watch is not None and args.watch <= 0:
        raise ValueError(f"--watch {args.watch:g}: the period must be above 0 seconds")
    if args.count is not None and (args.watch is None or args.count < 1):
        raise ValueError("--count N needs --watch and N >= 1")
    spec = pool_spec(args)
    with KVStore(spec, connect_timeout=args.timeout, timeout=args.timeout) as store:
        if args.watch is None:
            _print_stats(store.stats(), args.json, indent=2)
            return 0
        clear = sys.stdout.isatty() and not args.json
        shown = 0
        try:
            while args.count is None or shown < args.count:
                if shown:
                    time.sleep(args.watch)
                stats = store.stats()
                if not args.json:
                    print(CLEAR_SCREEN if clear else "\n" if shown else "", end="")
                    print(
                        f"beluga stats: {spec} at {time.strftime('%H:%M:%S')} "
                        f"(every {args.watch:g} s; Ctrl-C stops)"
                    )
                _print_stats(stats, args.json, indent=None)
                shown += 1
        except KeyboardInterrupt:
            pass
    return 0
