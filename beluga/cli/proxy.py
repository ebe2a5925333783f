"""``beluga proxy``: an OpenAI-compatible prefill/decode front for ``vllm serve`` engines."""

from __future__ import annotations

import argparse
import logging
import sys

from beluga.serving import proxy


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "proxy",
        help="send each OpenAI request to a prefill server, then to a decode server "
        "(until SIGTERM/SIGINT)",
        description="An OpenAI-compatible front (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics) for kv_producer and kv_consumer engines sharing a "
        "Beluga pool: each request is prefilled (max_tokens=1) on the prefill server with "
        "the fewest requests in flight, then decoded on the least loaded decode server, "
        "which loads the prompt's KV from the pool.",
    )
    for role, example in (("prefill", "http://HOST:8100"), ("decode", "http://HOST:8200")):
        p.add_argument(
            f"--{role}",
            action="append",
            default=[],
            metavar="URL[,URL...]",
            help=f"{role} servers' root URLs, e.g. {example} (comma-separated or repeated)",
        )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default %(default)s)")
    p.add_argument(
        "--port",
        type=int,
        default=proxy.DEFAULT_PORT,
        help="port to listen on (default %(default)s; 0: any free port, printed at start)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=proxy.DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="the most to wait for a server's next bytes (its answer, each chunk of a "
        "stream) and for a client's (default %(default)g)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=proxy.DEFAULT_CONNECT_TIMEOUT_S,
        metavar="SECONDS",
        help="the most to wait for a connection to a server (default %(default)g)",
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="least severe log records printed on stderr (default %(default)s; "
        "debug: one line a request, naming its servers)",
    )
    p.set_defaults(handler=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    server = proxy.ProxyServer(
        proxy.server_urls(args.prefill, "prefill"),
        proxy.server_urls(args.decode, "decode"),
        host=args.host,
        port=args.port,
        timeout=args.timeout,
        connect_timeout=args.connect_timeout,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("beluga proxy: %(levelname)s: %(message)s"))
    logger = logging.getLogger("beluga")
    logger.addHandler(handler)
    logger.setLevel(args.log_level.upper())
    proxy.serve(server, lambda url: print(f"beluga proxy: listening on {url}", flush=True))
    return 0
