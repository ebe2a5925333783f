"""``beluga proxy``: an OpenAI-compatible prefill/decode front for ``vllm serve`` engines.

Each completion request (``POST /v1/completions``, ``POST
/v1/chat/completions``) goes first to a prefill server (a ``kv_producer``
engine) with ``max_tokens=1``, which computes the prompt's KV and saves its
full blocks to the pool before it answers; then the client's request goes to
a decode server (a ``kv_consumer`` engine), which loads those blocks from the
pool and generates.  The decode server's answer goes back to the client,
streamed through chunk by chunk, unchanged, when the client asked for a
stream.  The pool is the only channel between the two, so any decode server
can take any request: each role's server is chosen by load alone, the one
with the fewest requests in flight through this proxy, ties in turn
(round-robin from the server after the last one chosen).

The prefill request is the client's with ``max_tokens=1`` (and
``max_completion_tokens=1`` when the client gave it) and ``stream=false``,
less three fields a one-token, non-streaming request must not carry (vLLM
refuses ``stream_options`` without ``stream`` and ``min_tokens`` above
``max_tokens``): ``stream_options``, ``min_tokens`` and
``min_completion_tokens``, as vLLM's own disaggregation proxies do.  The
decode request is the client's, plus the prefill answer's
``kv_transfer_params`` when it has them (vLLM's convention; Beluga's connector
needs none, the prompt names the blocks).  Both carry the client's
``Authorization`` header and one ``X-Request-Id`` (the client's, or a new one).

Failures are answered in OpenAI's error JSON (``{"error": {"message", "type",
"param", "code"}}``), each message naming the server and what went wrong:

- a server that cannot be reached (refused, reset, no connection or no answer
  within the timeouts) is left for another server of its role; when no server
  of the role answers: 502 (504 when every try timed out) naming each URL tried;
  a server that failed is tried again by later requests (no ejection);
- a server that answers an error status: its status and body pass through;
- a decode server that breaks off a stream (closes it, or sends nothing for
  ``timeout`` seconds): the client gets an SSE error event, then
  ``data: [DONE]``, and the stream ends, as vLLM ends a stream that fails;
- a client that leaves mid-stream: the decode request is closed too, so the
  engine stops generating.

Every wait has a bound: ``connect_timeout`` for a connection to a server,
``timeout`` for a server's next bytes (its answer's start, each chunk after)
and for the client's request body and each write to the client.

``GET /v1/models`` is forwarded to a decode server; ``GET /health`` answers
for the proxy itself (with each server's requests in flight; it probes no
server); ``GET /metrics`` serves Prometheus text, every name prefixed
``beluga_proxy_`` (see :class:`ProxyMetrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from beluga.errors import BelugaError

log = logging.getLogger(__name__)

DEFAULT_PORT = 8000
#: seconds to wait for a server's next bytes: a CPU engine may take minutes over a long prompt
DEFAULT_TIMEOUT_S = 600.0
#: seconds to wait for a TCP connection to a server
DEFAULT_CONNECT_TIMEOUT_S = 10.0
#: seconds a stopping proxy lets requests in flight finish before it cuts them off
SHUTDOWN_GRACE_S = 10.0
#: largest request body accepted (long prompts, images in chat messages)
MAX_BODY_BYTES = 64 << 20
#: below uvicorn's 5 s (vllm serve), so a pooled connection is never one the server is closing
KEEPALIVE_S = 4.0
#: upper bounds (seconds) of the latency histograms: a prefill takes ms to minutes
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

COMPLETION_ROUTES = ("/v1/completions", "/v1/chat/completions")
#: fields of the client's request a one-token, non-streaming prefill must not carry
PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")
FORWARDED_HEADERS = ("Authorization",)
SSE_DONE = b"data: [DONE]\n\n"


def server_urls(values: str | Iterable[str], role: str) -> list[str]:
    """The server URLs of ``--prefill`` or ``--decode``: comma-separated lists, checked.

    Each must be ``http(s)://HOST[:PORT]`` (the server's root: the proxy adds
    ``/v1/...``); a trailing ``/`` is dropped.  Raises ``ValueError`` naming
    the option for none at all, a malformed URL or one given twice.
    """
    items = [values] if isinstance(values, str) else list(values)
    urls = [u.strip() for item in items for u in item.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"--{role} needs at least one server URL, e.g. http://HOST:8100")
    checked = [_checked_url(u, role) for u in urls]
    twice = sorted({u for u in checked if checked.count(u) > 1})
    if twice:
        raise ValueError(f"--{role} names {', '.join(twice)} more than once")
    return checked


def _checked_url(text: str, role: str) -> str:
    hint = f"--{role} {text!r}: give the server's root URL, http://HOST:PORT"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{hint} ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(hint)
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{hint}, without a path, query or user (the proxy adds /v1/...)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request for a client's: one token, no stream (module docstring)."""
    prefill = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    return prefill


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error JSON for ``status`` with ``message``."""
    kind = "invalid_request_error" if status < 500 else "bad_gateway"
    if status == 504:
        kind = "gateway_timeout"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _error_response(status: int, message: str) -> web.Response:
    return web.json_response(error_body(status, message), status=status)


class ProxyMetrics:
    """The proxy's Prometheus metrics, in a registry of its own.

    - ``beluga_proxy_requests_total{route, outcome}``: requests answered, by
      outcome: ``ok``, ``bad_request``, ``prefill_unavailable``,
      ``prefill_error``, ``decode_unavailable``, ``decode_error``,
      ``stream_broken``, ``client_gone``;
    - ``beluga_proxy_errors_total{role, kind}``: each failure, including tries
      that another server then answered: ``role`` is ``prefill``, ``decode``
      or ``client``; ``kind`` is ``connect``, ``timeout``, ``disconnect``,
      ``status`` (an error status), ``bad_response``, ``stream`` (a stream
      broken off), ``bad_request`` or ``gone`` (a client that left);
    - ``beluga_proxy_in_flight{role, server}``: requests a server has now;
    - ``beluga_proxy_prefill_seconds{server}``: a prefill's time, sent to answered;
    - ``beluga_proxy_decode_seconds{server}``: a decode's time, sent to its
      last byte relayed (the whole generation);
    - the standard ``process_*`` metrics.

    A registry of its own, so that proxies in one process never share counts.
    Thread-safe (prometheus_client's metrics are); not fork-safe: a forked
    child must not serve the parent's counts.
    """

    def __init__(self, servers: dict[str, Sequence[str]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "beluga_proxy_requests",
            "Requests answered, by route and outcome",
            ["route", "outcome"],
            registry=reg,
        )
        self.errors = Counter(
            "beluga_proxy_errors",
            "Failures by role (prefill, decode, client) and kind, retried tries included",
            ["role", "kind"],
            registry=reg,
        )
        self.in_flight = Gauge(
            "beluga_proxy_in_flight",
            "Requests in flight to a server, by role and server URL",
            ["role", "server"],
            registry=reg,
        )
        self.prefill_seconds = Histogram(
            "beluga_proxy_prefill_seconds",
            "Seconds from sending a prefill request to its answer, by server",
            ["server"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.decode_seconds = Histogram(
            "beluga_proxy_decode_seconds",
            "Seconds from sending a decode request to its last byte relayed, by server",
            ["server"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        ProcessCollector(registry=reg)
        for role, urls in servers.items():
            for url in urls:
                self.in_flight.labels(role, url).set(0)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)


@dataclass(eq=False)
class _Server:
    url: str
    index: int
    in_flight: int = 0


class _Servers:
    """The servers of one role, and the choice among them by load alone."""

    def __init__(self, role: str, urls: Sequence[str], metrics: ProxyMetrics) -> None:
        self.role = role
        self.servers = [_Server(url, i) for i, url in enumerate(urls)]
        self._turn = 0
        self._metrics = metrics

    def pick(self, tried: Collection[_Server]) -> _Server | None:
        """The untried server with the fewest requests in flight, ties in turn; None if none."""
        n = len(self.servers)
        in_turn = [self.servers[(self._turn + i) % n] for i in range(n)]
        candidates = [s for s in in_turn if s not in tried]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda s: s.in_flight)  # the first of equals: in turn
        self._turn = (chosen.index + 1) % n
        return chosen

    @contextlib.contextmanager
    def busy(self, server: _Server) -> Iterator[None]:
        """Count a request in flight to ``server`` while inside."""
        gauge = self._metrics.in_flight.labels(self.role, server.url)
        server.in_flight += 1
        gauge.inc()
        try:
            yield
        finally:
            server.in_flight -= 1
            gauge.dec()


class _Refusal(Exception):
    """A request the proxy answers with an error of its own."""

    def __init__(self, status: int, message: str, outcome: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.outcome = outcome


@dataclass
class _Exchange:
    """One server's answer to a request, its body not read yet."""

    server: _Server
    response: aiohttp.ClientResponse
    sent_at: float


class ProxyServer:
    """The proxy: an aiohttp server in front of prefill and decode servers.

    ``async with ProxyServer(prefill, decode) as proxy:`` starts it on
    ``host:port`` (default ``127.0.0.1``, a free port) and stops it at exit;
    ``await proxy.start()`` (returns the port bound) and ``await
    proxy.close()`` do the same by hand.  ``proxy.url`` is where it listens.

    Not thread-safe: it lives on the event loop that started it, and every
    call must come from that loop (the choice of servers counts in-flight
    requests without locks, which one loop makes exact).  Not fork-safe: a
    forked child must not use it (the listening socket and client connections
    are the parent's).
    """

    def __init__(
        self,
        prefill: str | Iterable[str],
        decode: str | Iterable[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = DEFAULT_TIMEOUT_S,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"--port {port} is not a TCP port (0..65535; 0 picks a free one)")
        for name, value in (("--timeout", timeout), ("--connect-timeout", connect_timeout)):
            if not value > 0:
                raise ValueError(f"{name} {value:g}: give a number of seconds above 0")
        urls = {"prefill": server_urls(prefill, "prefill"), "decode": server_urls(decode, "decode")}
        self.host = host
        self.port = port
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.metrics = ProxyMetrics(urls)
        self._prefill = _Servers("prefill", urls["prefill"], self.metrics)
        self._decode = _Servers("decode", urls["decode"], self.metrics)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` the proxy listens on (the port bound, once started)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> int:
        """Listen on ``host:port`` and return the port bound; BelugaError if it cannot."""
        if self._runner is not None:
            raise BelugaError("this proxy is already running")
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
        for route in COMPLETION_ROUTES:
            app.router.add_post(route, self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.connect_timeout, sock_read=self.timeout
            ),
        )
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
        try:
            await self._runner.setup()
            await web.TCPSite(self._runner, self.host, self.port).start()
        except OSError as e:
            await self.close()
            raise BelugaError(
                f"cannot listen on {self.host}:{self.port}: {e.strerror or e}; "
                "pick another --host or --port (0 picks a free port)"
            ) from e
        except BaseException:
            await self.close()
            raise
        self.port = int(self._runner.addresses[0][1])
        log.info(
            "prefill %s; decode %s",
            ", ".join(s.url for s in self._prefill.servers),
            ", ".join(s.url for s in self._decode.servers),
        )
        return self.port

    async def close(self) -> None:
        """Stop listening, let requests in flight finish (a grace period), close connections.

        Safe to call twice.
        """
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()  # requests in flight still use the session meanwhile
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- routes ----------------------------------------------------------------

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        route = request.path
        try:
            response, outcome = await self._disaggregate(request)
        except _Refusal as refusal:
            response, outcome = _error_response(refusal.status, refusal.message), refusal.outcome
        self.metrics.requests.labels(route, outcome).inc()
        return response

    async def _models(self, request: web.Request) -> web.StreamResponse:
        try:
            headers = _forwarded_headers(request)
            async with self._send(self._decode, "GET", "/v1/models", None, headers) as exchange:
                body = await self._read(exchange, self._decode)
                response = _pass_through(exchange.response, body)
                outcome = "ok" if exchange.response.status == 200 else "decode_error"
        except _Refusal as refusal:
            response, outcome = _error_response(refusal.status, refusal.message), refusal.outcome
        self.metrics.requests.labels(request.path, outcome).inc()
        return response

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "in_flight": {
                    servers.role: {s.url: s.in_flight for s in servers.servers}
                    for servers in (self._prefill, self._decode)
                },
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    # -- one completion ----------------------------------------------------------

    async def _disaggregate(self, request: web.Request) -> tuple[web.StreamResponse, str]:
        """Prefill on one server, decode on another; the response and the outcome."""
        body = await self._request_body(request)
        headers = _forwarded_headers(request)
        rid = headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        path = request.path

        async with self._send(self._prefill, "POST", path, prefill_request(body), headers) as ex:
            answer = await self._read(ex, self._prefill)
            if ex.response.status != 200:
                self._failed(
                    "prefill", "status", ex.server, f"answered {ex.response.status}, passed on"
                )
                return _pass_through(ex.response, answer), "prefill_error"
            self.metrics.prefill_seconds.labels(ex.server.url).observe(perf_counter() - ex.sent_at)
            prefill_url = ex.server.url
        decode_body = dict(body)
        kv_transfer_params = self._kv_transfer_params(answer, prefill_url)
        if kv_transfer_params is not None:
            decode_body["kv_transfer_params"] = kv_transfer_params

        async with self._send(self._decode, "POST", path, decode_body, headers) as ex:
            log.debug("%s %s: prefill %s, decode %s", path, rid, prefill_url, ex.server.url)
            if ex.response.status != 200:
                answer = await self._read(ex, self._decode)
                self._failed(
                    "decode", "status", ex.server, f"answered {ex.response.status}, passed on"
                )
                return _pass_through(ex.response, answer), "decode_error"
            if body.get("stream") is True:
                return await self._relay(request, ex)
            answer = await self._read(ex, self._decode)
            self.metrics.decode_seconds.labels(ex.server.url).observe(perf_counter() - ex.sent_at)
            return _pass_through(ex.response, answer), "ok"

    async def _request_body(self, request: web.Request) -> dict[str, Any]:
        """The client's JSON object; a refusal (400 or 408) for anything else.

        A body over MAX_BODY_BYTES is aiohttp's 413, which ``_json_errors`` words.
        """
        try:
            raw = await asyncio.wait_for(request.read(), self.timeout)
        except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
            raise self._bad_request(408, f"no request body within {self.timeout:g} s") from None
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise self._bad_request(400, f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise self._bad_request(400, "the request body must be a JSON object")
        return body

    def _bad_request(self, status: int, message: str) -> _Refusal:
        self.metrics.errors.labels("client", "bad_request").inc()
        return _Refusal(status, message, "bad_request")

    @contextlib.asynccontextmanager
    async def _send(
        self,
        servers: _Servers,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        headers: dict[str, str],
    ) -> AsyncIterator[_Exchange]:
        """The answer of the first server of ``servers`` that answers, tried by load.

        The server counts as busy until the block exits; its connection is
        closed then unless its answer was read to the end (so a client that
        left mid-stream closes the server's request).  A refusal (502, or 504
        when every try timed out) when no server answers.
        """
        tried: list[_Server] = []
        failures: list[str] = []
        timeouts = 0
        while (server := servers.pick(tried)) is not None:
            tried.append(server)
            with servers.busy(server):
                sent_at = perf_counter()
                try:
                    response = await self._session_or_fail().request(
                        method, server.url + path, json=body, headers=headers
                    )
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    kind, reason = self._why(e)
                    timeouts += kind == "timeout"
                    self._failed(servers.role, kind, server, reason)
                    failures.append(f"{server.url} ({reason})")
                    continue
                try:
                    yield _Exchange(server, response, sent_at)
                finally:
                    response.release()  # closes the connection unless read to the end
                return
        status = 504 if timeouts == len(tried) else 502
        raise _Refusal(
            status,
            f"no {servers.role} server answered {path}: {'; '.join(failures)}",
            f"{servers.role}_unavailable",
        )

    def _session_or_fail(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise BelugaError("the proxy is not running: start() it first")
        return self._session

    async def _read(self, exchange: _Exchange, servers: _Servers) -> bytes:
        """A server's whole answer; a 502 refusal when it breaks off."""
        try:
            return await exchange.response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            kind, reason = self._why(e)
            self._failed(servers.role, kind, exchange.server, reason)
            raise _Refusal(
                504 if kind == "timeout" else 502,
                f"{servers.role} server {exchange.server.url} broke off its answer: {reason}",
                f"{servers.role}_error",
            ) from None

    async def _relay(
        self, request: web.Request, exchange: _Exchange
    ) -> tuple[web.StreamResponse, str]:
        """Stream the decode server's answer to the client, chunk by chunk, unchanged."""
        upstream = exchange.response
        out = web.StreamResponse(
            headers={
                "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
            }
        )
        await out.prepare(request)
        last = b"\n\n"
        while True:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                _, reason = self._why(e)
                self._failed("decode", "stream", exchange.server, reason)
                message = f"decode server {exchange.server.url} broke off the stream: {reason}"
                event = b"data: " + json.dumps(error_body(502, message)).encode() + b"\n\n"
                # end a half-sent event first, so that the error reads as an event of its own
                opening = b"" if last.endswith(b"\n\n") else b"\n\n"
                await self._write(out, opening + event + SSE_DONE)
                return out, "stream_broken"
            if not chunk:
                break
            if not await self._write(out, chunk):
                self.metrics.errors.labels("client", "gone").inc()
                log.info("a client left mid-stream: closing its request to %s", exchange.server.url)
                return out, "client_gone"
            last = (last + chunk)[-2:]
        seconds = perf_counter() - exchange.sent_at
        self.metrics.decode_seconds.labels(exchange.server.url).observe(seconds)
        return out, "ok"

    async def _write(self, out: web.StreamResponse, data: bytes) -> bool:
        """Write to the client; False when it is gone or takes no bytes for ``timeout`` s."""
        try:
            await asyncio.wait_for(out.write(data), self.timeout)
        except (ConnectionError, asyncio.TimeoutError):
            return False
        return True

    def _why(self, error: BaseException) -> tuple[str, str]:
        """The kind of a failure talking to a server (for the metrics) and a reason for people."""
        if isinstance(error, aiohttp.ConnectionTimeoutError):
            return "timeout", f"no connection within {self.connect_timeout:g} s"
        if isinstance(error, asyncio.TimeoutError):
            return "timeout", f"no bytes within {self.timeout:g} s (--timeout)"
        if isinstance(error, aiohttp.ClientConnectorError):
            errno = error.os_error.errno
            return "connect", f"cannot connect: {os.strerror(errno) if errno else error}"
        if isinstance(error, aiohttp.ServerDisconnectedError):
            return "disconnect", "the server closed the connection"
        if isinstance(error, aiohttp.ClientPayloadError):
            return "disconnect", "the server closed the connection before the end of its answer"
        return "disconnect", str(error) or type(error).__name__

    def _kv_transfer_params(self, answer: bytes, prefill_url: str) -> Any:
        """The prefill answer's ``kv_transfer_params`` (None if it has none); 502 if not JSON."""
        try:
            parsed = json.loads(answer)
        except ValueError:
            self.metrics.errors.labels("prefill", "bad_response").inc()
            raise _Refusal(
                502,
                f"prefill server {prefill_url} answered 200 with a body that is not JSON",
                "prefill_error",
            ) from None
        return parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None

    def _failed(self, role: str, kind: str, server: _Server, reason: str) -> None:
        self.metrics.errors.labels(role, kind).inc()
        log.warning("%s server %s: %s", role, server.url, reason)


def _forwarded_headers(request: web.Request) -> dict[str, str]:
    """The client's headers that the servers get too (its API key)."""
    return {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}


def _pass_through(upstream: aiohttp.ClientResponse, body: bytes) -> web.Response:
    """A server's answer as the client's: its status, content type and body."""
    return web.Response(
        status=upstream.status,
        body=body,
        headers={"Content-Type": upstream.headers.get("Content-Type", "application/json")},
    )


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, ...) in OpenAI's error JSON."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error_response(e.status, f"{request.method} {request.path}: {e.reason}")


def serve(proxy: ProxyServer, announce: Callable[[str], None] = print) -> None:
    """Run ``proxy`` until SIGTERM or SIGINT, then stop it cleanly (main thread only).

    ``announce`` gets the URL it listens on once it does.
    """
    asyncio.run(_serve_until_signalled(proxy, announce))


async def _serve_until_signalled(proxy: ProxyServer, announce: Callable[[str], None]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # recorded, then run in the loop: beluga.signals
        loop.add_signal_handler(sig, stop.set)
    async with proxy:
        announce(proxy.url)
        await stop.wait()
        log.info("stopping: %g s for requests in flight to finish", SHUTDOWN_GRACE_S)
