"""``beluga demo``: the whole system end to end on this machine, in a few minutes.

A scratch pool made for the model's KV blocks, the metadata server, two
engine processes over a real (random-weight) Qwen2 model, and a long-context
trace replayed twice under each scheduler; a progress bar while it runs and a
summary table at the end.  Everything is stopped and removed afterwards.
``beluga bench e2e`` runs the same experiment for figures (JSON, a chart).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from beluga.errors import BackendUnavailableError
from beluga.serving.scheduler import SCHEDULERS
from beluga.units import parse_size

_NEEDS = ("torch", "transformers", "tqdm")


def add_e2e_args(parser: argparse.ArgumentParser, figures: bool = False) -> None:
    """The experiment's options, shared with ``beluga bench e2e``; ``figures`` adds the
    benchmark's own (repetitions, capacity, bursts, prefill/decode disaggregation)."""
    g = parser.add_argument_group("experiment")
    g.add_argument(
        "--model",
        default="small",
        help="model size: small (8 layers, hidden 512; default), tiny (4 layers, hidden 256), "
        "wide-kv (12 layers, hidden 512, 768 KiB KV blocks) or, on a GPU, 7b (Qwen2-7B's "
        "shape in bfloat16, 15,000-token documents by default)",
    )
    g.add_argument("--documents", type=int, default=4, help="long documents in the trace")
    g.add_argument(
        "--questions",
        type=int,
        nargs=2,
        default=(2, 6),
        metavar=("MIN", "MAX"),
        help="questions per document, drawn between MIN and MAX (default 2 6)",
    )
    g.add_argument(
        "--context-tokens",
        type=int,
        help="tokens per document (default 4096; 15000 for --model 7b, LV-Eval's length)",
    )
    g.add_argument("--engines", type=int, default=2, help="engine processes (default 2)")
    g.add_argument(
        "--schedulers",
        default=",".join(SCHEDULERS),
        help=f"comma-separated, from {', '.join(SCHEDULERS)} (default: both)",
    )
    g.add_argument(
        "--rate",
        type=_rate,
        help="Poisson arrivals in requests/s; 0: the whole trace at once (the default on the "
        "CPU); auto: half of what the engines serve, measured first (the default on a GPU, "
        "so that TTFT is service time rather than queueing)",
    )
    g.add_argument("--threads", type=int, default=1, help="torch threads per engine (default 1)")
    g.add_argument(
        "--device",
        default="auto",
        help="where engines run the model and keep KV: cpu, cuda, cuda:N (default auto: "
        "cuda when torch sees a GPU, so KV moves through the GPU kernel; else cpu)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--pool",
        metavar="SPEC",
        help="create the experiment's pool here (it must not exist; it is removed afterwards; "
        "default: a scratch file in /dev/shm)",
    )
    if not figures:
        return
    f = parser.add_argument_group("figures")
    f.add_argument(
        "--repeat",
        type=int,
        default=3,
        metavar="N",
        help="run everything N times from scratch, systems interleaved; report medians and "
        "ranges (default 3)",
    )
    f.add_argument(
        "--capacity",
        type=parse_size,
        metavar="BYTES",
        help="bytes of KV each store may hold before it evicts, the same for Beluga and "
        "Mooncake (e.g. 512M; default: what the trace stores, with 25%% headroom)",
    )
    f.add_argument(
        "--burst",
        type=int,
        default=1,
        metavar="K",
        help="each document's first K questions arrive at once, so that engines routed by "
        "load alone compute the same blocks (default 1: no bursts)",
    )
    f.add_argument(
        "--pd",
        type=_prefill_decode,
        metavar="P:D",
        help="prefill/decode disaggregation: P prefill and D decode engines over one pool "
        "(--engines is then P+D; with --baseline mooncake, over Mooncake Store too)",
    )
    f.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        metavar="N",
        help="with --pd, tokens each decode engine generates per request (default 16)",
    )


def _rate(text: str) -> float | str:
    """Requests/s, or 'auto' (measured below saturation)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rate takes requests/s or auto, not {text!r}") from None


def _prefill_decode(text: str) -> tuple[int, int]:
    """'1:1' -> (1, 1): prefill and decode engines."""
    try:
        prefill, decode = (int(n) for n in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pd takes P:D, e.g. 1:1, not {text!r}") from None
    return prefill, decode


def e2e_settings(args: argparse.Namespace) -> Any:
    """The experiment the command line describes, once its dependencies are known to be there."""
    for name in _NEEDS:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise BackendUnavailableError(
                f"the end-to-end experiment needs {name}: pip install torch==2.13.0, then "
                "pip install 'beluga-kvcache[model]'"
            ) from e
    import torch

    from beluga.bench.e2e_settings import CONTEXT_TOKENS, DEFAULT_CONTEXT_TOKENS, Settings
    from beluga.serving.trace import TraceShape

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rate = args.rate  # None when not given: automatic on a GPU, all at once on the CPU
    if rate is None:
        rate = "auto" if device.startswith("cuda") else 0.0

    trace = TraceShape(
        documents=args.documents,
        min_questions=args.questions[0],
        max_questions=args.questions[1],
        context_tokens=args.context_tokens
        or CONTEXT_TOKENS.get(args.model, DEFAULT_CONTEXT_TOKENS),
    )
    pd = getattr(args, "pd", None)  # the figures' options (bench e2e); the demo has none
    return Settings(
        model=args.model,
        trace=trace,
        engines=sum(pd) if pd else args.engines,
        schedulers=tuple(s.strip() for s in args.schedulers.split(",") if s.strip()),
        seed=args.seed,
        rate=None if rate == "auto" else rate,
        threads=args.threads,
        device=device,
        repeat=getattr(args, "repeat", 1),
        capacity=getattr(args, "capacity", None),
        burst=getattr(args, "burst", 1),
        pd=pd,
        max_tokens=getattr(args, "max_tokens", 16),
    )


def run_with_progress(settings: Any, pool: str | None) -> dict[str, Any]:
    """Run the experiment under a progress bar (on stderr)."""
    from tqdm import tqdm

    from beluga.bench import e2e

    total = 2 * len(settings.schedulers) * len(settings.requests()) * settings.repeat
    with tqdm(total=total, unit="req", desc="starting", dynamic_ncols=True) as bar:

        def on_record(scheduler: str, pass_no: int, record: Any) -> None:
            bar.update(1)
            bar.set_postfix(ttft=f"{record.ttft:.2f}s", engine=record.engine, refresh=False)

        on_phase: Callable[[str], None] = bar.set_description_str
        return e2e.run(settings, pool, on_record=on_record, on_phase=on_phase)


def summary(result: dict[str, Any]) -> str:
    """The table, then each scheduler's pass-2 / pass-1 TTFT against the target, capacity,
    evictions and blocks computed twice."""
    from beluga.bench.e2e_report import (
        COLUMNS,
        arrivals_note,
        capacity_line,
        duplicate_note,
        hit_shortfall,
    )
    from beluga.bench.stats import format_table

    s = result["settings"]
    runs = len(result.get("runs", [])) or 1
    lines = [
        f"model {s['model']} ({result['model_params'] / 1e6:.1f} M parameters, KV "
        f"{s['kv_format']}), {s['engines']} engines, {result['requests_per_pass']} requests "
        f"per pass over {s['trace']['documents']} documents of {s['trace']['context_tokens']} "
        f"tokens ({arrivals_note(s)})" + (f"; medians over {runs} runs" if runs > 1 else ""),
        "",
        format_table(result["rows"], COLUMNS),
        "",
    ]
    for t in result["targets"]:
        verdict = "met" if t["met"] else "NOT met"
        low, high = t.get("range", (t["pass2_over_pass1_ttft"],) * 2)
        spread = f" (range {100 * low:.1f}-{100 * high:.1f}%)" if runs > 1 else ""
        lines.append(
            f"{t['scheduler']}: pass-2 mean TTFT is {100 * t['pass2_over_pass1_ttft']:.1f}% of "
            f"pass 1's{spread} (target <= {100 * t['target']:.0f}%: {verdict})"
        )
    lines.append(capacity_line(s["capacity"]))
    for row in result["rows"]:
        why = hit_shortfall(row) if row["pass"] == 2 else None
        if why:
            lines.append(f"{row['scheduler']} pass 2: {why}")
        if row.get("duplicate_blocks"):
            lines.append(f"{row['scheduler']} pass {row['pass']}: {duplicate_note(row)}")
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "demo",
        help="run the whole system end to end: pool, server, engines, a trace twice",
    )
    add_e2e_args(d)
    d.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    result = run_with_progress(e2e_settings(args), args.pool)
    print(summary(result))
    return 0
