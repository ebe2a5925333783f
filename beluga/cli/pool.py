"""``beluga pool create|info|destroy|nodes``."""

from __future__ import annotations

import argparse
import json

from beluga.cli.common import add_pool_args, pool_spec
from beluga.pool import Geometry, Pool
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
    c.add_argument("--force", action="store_true", help="replace an existing pool")
    c.set_defaults(handler=create)

    i = cmds.add_parser("info", help="print the superblock, regions and hosts")
    add_pool_args(i)
    i.add_argument("--json", action="store_true", help="JSON instead of text")
    i.set_defaults(handler=info)

    d = cmds.add_parser("destroy", help="remove a pool")
    add_pool_args(d)
    d.set_defaults(handler=destroy)

    n = cmds.add_parser("nodes", help="list NUMA nodes and which have no CPUs")
    n.set_defaults(handler=nodes)


def create(args: argparse.Namespace) -> int:
    geometry = Geometry(
        max_hosts=args.max_hosts, block_size=args.block_size, rpc_bytes_per_host=args.rpc_per_host
    )
    with Pool.create(
        pool_spec(args), args.size, geometry=geometry, label=args.label, force=args.force
    ) as p:
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
            value = f"pid {value['pid']} on {where}" if value else "none running"
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
    spec = pool_spec(args)
    Pool.destroy(spec)
    print(f"destroyed {spec}")
    return 0


def nodes(args: argparse.Namespace) -> int:
    from beluga.pool.numa import list_nodes

    for n in list_nodes():
        kind = "CPU-less (CXL-like)" if n.cpuless else f"cpus {n.cpus}"
        print(f"node {n.node}: {n.total_bytes >> 20} MiB, {n.free_bytes >> 20} MiB free, {kind}")
    return 0
