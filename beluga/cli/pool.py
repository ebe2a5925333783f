"""``beluga pool create|info|destroy|nodes``."""

from __future__ import annotations

import argparse
import contextlib
import json
import time

from beluga.cli.common import add_pool_args, pool_spec
from beluga.pool import Geometry, Pool, parse_spec, removal_guard
from beluga.units import parse_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pool", help="create, inspect and destroy pools")
    cmds = p.add_subparsers(dest="pool_command", required=True, metavar="ACTION")

    c = cmds.add_parser("create", help="format a new pool")
    add_pool_args(c)
    c.add_argument(
        "--size",
        type=parse_size,
        default=parse_size("1G"),
        help="pool size, a 2 MiB multiple (default 1G)",
    )
    c.add_argument("--max-hosts", type=int, default=Geometry.max_hosts)
    c.add_argument(
        "--block-size",
        type=parse_size,
        default=Geometry.block_size,
        help="pool block size in bytes, a 4K multiple (default 64K)",
    )
    c.add_argument(
        "--rpc-per-host",
        type=parse_size,
        default=Geometry.rpc_bytes_per_host,
        help="RPC area bytes per host (default 1M)",
    )
    c.add_argument("--label", default="", help="free text kept in the superblock")
    c.add_argument(
        "--force",
        action="store_true",
        help="replace an existing Beluga pool (never a file that is not one, never one in use)",
    )
    _add_ignore_live_hosts(c)
    c.set_defaults(handler=create)

    i = cmds.add_parser("info", help="print the superblock, regions and hosts")
    add_pool_args(i)
    i.add_argument("--json", action="store_true", help="JSON instead of text")
    i.set_defaults(handler=info)

    d = cmds.add_parser(
        "destroy", help="remove a pool (refused for what is not a Beluga pool or is in use)"
    )
    add_pool_args(d)
    _add_ignore_live_hosts(d)
    d.set_defaults(handler=destroy)

    n = cmds.add_parser("nodes", help="list NUMA nodes and which have no CPUs")
    n.set_defaults(handler=nodes)


def _add_ignore_live_hosts(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ignore-live-hosts",
        action="store_true",
        help="go ahead although hosts (or a server on another host) look alive; "
        "a live server on this machine still refuses",
    )


def create(args: argparse.Namespace) -> int:
    geometry = Geometry(
        max_hosts=args.max_hosts, block_size=args.block_size, rpc_bytes_per_host=args.rpc_per_host
    )
    backend = parse_spec(pool_spec(args))
    with contextlib.ExitStack() as guarded:
        if args.force and backend.exists():
            guarded.enter_context(
                removal_guard(backend, "replace", ignore_live_hosts=args.ignore_live_hosts)
            )
        p = guarded.enter_context(
            Pool.create(backend, args.size, geometry=geometry, label=args.label, force=args.force)
        )
        sb = p.superblock
        print(
            f"created {p.spec}: {sb.pool_size} bytes, {sb.nblocks} blocks of {sb.block_size} "
            f"bytes, {sb.max_hosts} hosts"
        )
    return 0


def info(args: argparse.Namespace) -> int:
    with Pool.attach(pool_spec(args)) as p:
        facts = p.info()
    if args.json:
        print(json.dumps(facts, indent=2, default=str))
        return 0
    for key, value in facts.items():
        if key == "members":
            continue
        if key == "server":
            where = "this machine" if value and value["same_machine"] else "another host"
            text = f"pid {value['pid']} on {where}" if value else "none running"
            if value and value["since_ns"]:
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value["since_ns"] / 1e9))
                text += f", serving since {since} UTC"
            value = text
        elif isinstance(value, dict):
            value = f"offset {value['offset']}, {value['length']} bytes"
        print(f"{key:>16}: {value}")
    print(f"{'hosts':>16}: {len(facts['members'])} registered")
    for m in facts["members"]:
        state = "alive" if m["alive"] else m["state"]
        print(
            f"{'':>16}  host {m['host_id']}: pid {m['pid']}, {state}, generation {m['generation']}"
        )
    return 0


def destroy(args: argparse.Namespace) -> int:
    with removal_guard(
        pool_spec(args), "destroy", ignore_live_hosts=args.ignore_live_hosts
    ) as backend:
        Pool.destroy(backend)
    print(f"destroyed {backend.spec}")
    return 0


def nodes(args: argparse.Namespace) -> int:
    from beluga.pool.numa import list_nodes

    for n in list_nodes():
        kind = "CPU-less (CXL-like)" if n.cpuless else f"cpus {n.cpus}"
        print(f"node {n.node}: {n.total_bytes >> 20} MiB, {n.free_bytes >> 20} MiB free, {kind}")
    return 0
