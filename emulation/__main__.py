"""python -m emulation build | run TOPOLOGY [--timeout S] [--script FILE | -- CMD...]"""

from __future__ import annotations

import argparse
import sys

from beluga.signals import interrupt_on_signals
from emulation.builder import build
from emulation.errors import SandboxError
from emulation.runner import DEFAULT_TIMEOUT_S, Result, run
from emulation.topology import TOPOLOGIES

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in argv:  # everything after it is the guest command, options included
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    args = _parser().parse_args(argv)
    try:
        # a terminated CLI unwinds like Ctrl-C, so every QEMU it started is ended: the
        # handler only records SIGTERM, and the runner's waiting loop raises at its next look
        # (beluga.signals; a build notices it between its steps)
        with interrupt_on_signals():
            if args.cmd == "build":
                if command:
                    raise ValueError("build takes no command after --")
                build()
                return 0
            if args.script and command:
                raise ValueError("give either --script FILE or -- CMD..., not both")
            result = run(args.topology, args.script or command or None, args.timeout)
    except (SandboxError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, ValueError) else 1
    except KeyboardInterrupt:
        print("interrupted: every QEMU of this run was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    _print(result)
    return result.returncode


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m emulation", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="install QEMU and build the guest kernel and initramfs (cached)")
    run_p = sub.add_parser(
        "run",
        help="boot a topology and run a script in its guests",
        description="Without --script or a command, each guest runs the topology's own check.",
    )
    run_p.add_argument("topology", choices=sorted(TOPOLOGIES))
    run_p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"hard limit for the whole run in seconds (default {DEFAULT_TIMEOUT_S:g})",
    )
    run_p.add_argument(
        "--script", help="a file to run in each guest (.py with this Python); or end with -- CMD..."
    )
    return parser


def _print(result: Result) -> None:
    """The scripts' output on stdout; a summary of each guest on stderr."""
    sys.stdout.write(result.output)
    sys.stdout.flush()
    for g in result.guests:
        timing = ""
        if g.boot_s is not None:
            timing = f", booted in {g.boot_s:.1f} s"
        if g.script_s is not None:
            timing += f", script ran {g.script_s:.1f} s"
        status = f"exit {g.returncode}{timing}" + (f" ({g.problem})" if g.problem else "")
        print(f"guest {g.index}: {status}; console log: {g.console}", file=sys.stderr)
    verdict = "passed" if result.returncode == 0 else f"FAILED with exit {result.returncode}"
    print(f"{result.topology}: {verdict} in {result.seconds:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
