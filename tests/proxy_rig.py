"""The rig of the beluga proxy's tests: fake engines, a proxy in front of them, a client.

Each request is prefilled on one server and decoded on another, over real HTTP.

The servers are small OpenAI-compatible aiohttp servers in this process
(:class:`FakeEngine`) that record every request they get and answer as a test
tells them; the proxy is the real one, on this process's event loop, or the
``beluga proxy`` command in a process of its own.  Each test's scenario runs
under one deadline and every wait inside it has its own (``WAIT_S``), so a
bug fails a test instead of hanging it; no assert is about time.

The tests, by duty: tests/test_proxy_routing.py (what each server is sent, which
server, the other routes), tests/test_proxy_failures.py (servers and clients failing),
tests/test_proxy_command.py (the Python API and the ``beluga proxy`` command).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from beluga.serving.proxy import ProxyServer

WAIT_S = 10.0  # the most any one wait of a test may take
DEADLINE_S = 60.0  # the most a whole scenario may take
MODEL = "fake-model"
MODELS = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}
COMPLETION = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 7, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5}
REQUESTS = "beluga_proxy_requests_total"
ERROR = {"error": {"message": "max_tokens is too large", "type": "BadRequestError", "code": 400}}


def run(scenario: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario, DEADLINE_S))


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait until ``predicate()`` holds, at most WAIT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"waited {WAIT_S} s for {what}")
        await asyncio.sleep(0.005)


def prompt_of(body: dict[str, Any]) -> str:
    return str(body["prompt"]) if "prompt" in body else str(body["messages"][-1]["content"])


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def dead_urls(n: int) -> list[str]:
    """URLs of ``n`` distinct ports nobody listens on (bound together, then closed)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]


@dataclass
class Seen:
    path: str
    body: dict[str, Any] | None
    headers: Mapping[str, str]
    peer: tuple[str, int]  # the proxy's end of the connection


@dataclass
class FakeEngine:
    """An OpenAI-compatible server that records what it is sent and answers as told.

    A completion answer's text, and each streamed event's, names the engine.
    """

    name: str
    seen: list[Seen] = field(default_factory=list)
    status: int = 200  # anything else: answer ERROR with this status
    kv_transfer_params: dict[str, Any] | None = None
    events: int = 3  # events of a stream, then data: [DONE]
    holding: set[str] = field(default_factory=set)  # prompts held until `release`
    release: asyncio.Event = field(default_factory=asyncio.Event)
    lockstep: asyncio.Queue[None] | None = None  # each event after the first waits for an item
    hang_up: bool = False  # close the connection instead of answering
    raw_answer: bytes | None = None  # answer 200 with these bytes instead of JSON
    break_after: int | None = None  # close the connection after this many events
    half_event: bytes = b""  # ... and after these bytes of the next one
    stall_after: int | None = None  # send nothing after this many events, until `release`
    endless: bool = False  # stream until the client leaves, then set `left`
    left: asyncio.Event = field(default_factory=asyncio.Event)
    sent: list[bytes] = field(default_factory=list)  # the bytes of the last stream
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def bodies(self, path: str | None = None) -> list[dict[str, Any] | None]:
        return [s.body for s in self.seen if path is None or s.path == path]

    def prompts(self) -> list[str]:
        return [prompt_of(s.body) for s in self.seen if s.body is not None]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.seen.append(
            Seen(
                request.path,
                body,
                request.headers.copy(),
                request.transport.get_extra_info("peername"),
            )
        )
        if request.path == "/v1/models":
            return web.json_response(MODELS)
        assert body is not None
        if prompt_of(body) in self.holding:
            await asyncio.wait_for(self.release.wait(), WAIT_S)
        if self.hang_up:
            assert request.transport is not None
            request.transport.close()
        if self.status != 200:
            return web.json_response(ERROR, status=self.status)
        if self.raw_answer is not None:
            return web.Response(body=self.raw_answer, content_type="text/plain")
        if body.get("stream"):
            return await self._stream(request)
        answer: dict[str, Any] = {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": self.name, "finish_reason": "length"}],
        }
        if self.kv_transfer_params is not None:
            answer["kv_transfer_params"] = self.kv_transfer_params
        return web.json_response(answer)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)
        self.sent = []
        i = 0
        while self.endless or i < self.events:
            if i == self.break_after:
                assert request.transport is not None
                if self.half_event:
                    await out.write(self.half_event)
                    self.sent.append(self.half_event)
                request.transport.close()
                return out
            if i == self.stall_after:
                await asyncio.wait_for(self.release.wait(), WAIT_S)
                return out
            if i and self.lockstep is not None:
                await asyncio.wait_for(self.lockstep.get(), WAIT_S)
            chunk = sse({"id": "cmpl-1", "choices": [{"index": 0, "text": f"{self.name} {i}"}]})
            try:
                await out.write(chunk)
            except ConnectionError:
                self.left.set()
                return out
            self.sent.append(chunk)
            i += 1
            if self.endless:
                await asyncio.sleep(0.005)
        await out.write(b"data: [DONE]\n\n")
        self.sent.append(b"data: [DONE]\n\n")
        return out


@dataclass
class Rig:
    """A proxy in front of fake engines, and a client."""

    proxy: ProxyServer
    prefill: list[FakeEngine]
    decode: list[FakeEngine]
    dead: list[str]  # the URLs given that nobody serves
    client: aiohttp.ClientSession

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.client.post(self.proxy.url + path, data=data, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def get(self, path: str) -> tuple[int, str]:
        async with self.client.get(self.proxy.url + path) as r:
            return r.status, await r.text()

    async def metrics(self) -> Samples:
        status, text = await self.get("/metrics")
        assert status == 200
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def sample(metrics: Samples, name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def in_flight(metrics: Samples, role: str, url: str) -> float:
    """The in-flight gauge of one server (a KeyError if the proxy exports none)."""
    return metrics[("beluga_proxy_in_flight", frozenset({"role": role, "server": url}.items()))]


def completions(metrics: Samples, outcome: str) -> float:
    """beluga_proxy_requests_total of /v1/completions with ``outcome``."""
    return sample(metrics, REQUESTS, route="/v1/completions", outcome=outcome)


@contextlib.asynccontextmanager
async def rig(
    prefill: int = 1,
    decode: int = 1,
    *,
    dead_prefill: int = 0,
    dead_decode: int = 0,
    **options: Any,
) -> AsyncIterator[Rig]:
    """``prefill`` and ``decode`` engines (after ``dead_*`` URLs nobody serves) and a proxy."""
    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for name in [f"prefill{i}" for i in range(prefill)] + [f"decode{i}" for i in range(decode)]:
            engine = await FakeEngine(name).start()
            stack.push_async_callback(engine.close)
            engines.append(engine)
        p, d = engines[:prefill], engines[prefill:]
        dead = dead_urls(dead_prefill + dead_decode)
        proxy = ProxyServer(
            dead[:dead_prefill] + [e.url for e in p],
            dead[dead_prefill:] + [e.url for e in d],
            **options,
        )
        await stack.enter_async_context(proxy)
        client = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S))
        )
        yield Rig(proxy, p, d, dead, client)
