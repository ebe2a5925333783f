"""beluga proxy: each request prefilled on one server and decoded on another, over real HTTP.

The servers are small OpenAI-compatible aiohttp servers in this process
(:class:`FakeEngine`) that record every request they get and answer as a test
tells them; the proxy is the real one, on this process's event loop, or the
``beluga proxy`` command in a process of its own.  Each test's scenario runs
under one deadline and every wait inside it has its own (``WAIT_S``), so a
bug fails a test instead of hanging it; no assert is about time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from beluga.cli import main
from beluga.errors import BelugaError
from beluga.serving.proxy import ProxyServer, server_urls

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


# -- what each server is sent ----------------------------------------------------------


def test_completion_is_prefilled_with_one_token_then_decoded_as_sent() -> None:
    body = {**COMPLETION, "min_tokens": 2, "seed": 3, "logprobs": 1}
    headers = {"Authorization": "Bearer key-1", "X-Request-Id": "req-1"}

    async def scenario() -> None:
        async with rig() as r:
            status, answer = await r.post("/v1/completions", body, headers)
            assert status == 200
            assert answer["choices"][0]["text"] == "decode0"
            prefill_body = {k: v for k, v in body.items() if k != "min_tokens"}
            assert r.prefill[0].bodies() == [{**prefill_body, "max_tokens": 1, "stream": False}]
            assert r.decode[0].bodies() == [body]
            for engine in (r.prefill[0], r.decode[0]):
                assert [s.path for s in engine.seen] == ["/v1/completions"]
                assert engine.seen[0].headers["Authorization"] == "Bearer key-1"
                assert engine.seen[0].headers["X-Request-Id"] == "req-1"

    run(scenario())


@pytest.mark.parametrize("max_completion_tokens", [None, 9])
def test_chat_prefill_caps_max_completion_tokens_only_when_given(
    max_completion_tokens: int | None,
) -> None:
    body = dict(CHAT)
    if max_completion_tokens is not None:
        body["max_completion_tokens"] = max_completion_tokens

    async def scenario() -> None:
        async with rig() as r:
            status, answer = await r.post("/v1/chat/completions", body)
            assert status == 200 and answer["choices"][0]["text"] == "decode0"
            expected = {**body, "max_tokens": 1, "stream": False}
            if max_completion_tokens is not None:
                expected["max_completion_tokens"] = 1
            assert r.prefill[0].bodies("/v1/chat/completions") == [expected]
            assert r.decode[0].bodies("/v1/chat/completions") == [body]
            # the one X-Request-Id the proxy made names both halves
            ids = {e.seen[0].headers["X-Request-Id"] for e in (r.prefill[0], r.decode[0])}
            assert len(ids) == 1 and ids != {""}

    run(scenario())


def test_kv_transfer_params_of_the_prefill_go_to_the_decode() -> None:
    params = {"remote_block_ids": [4, 5], "remote_engine_id": "p0", "do_remote_prefill": True}

    async def scenario() -> None:
        async with rig() as r:
            r.prefill[0].kv_transfer_params = params
            assert (await r.post("/v1/completions", COMPLETION))[0] == 200
            assert r.decode[0].bodies() == [{**COMPLETION, "kv_transfer_params": params}]

    run(scenario())


def test_stream_passes_each_chunk_through_as_it_comes_unchanged() -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}

    async def scenario() -> None:
        async with rig() as r:
            decode = r.decode[0]
            decode.events = 5
            decode.lockstep = asyncio.Queue()
            received = []
            async with r.client.post(r.proxy.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                # the engine sends event i+1 only once the client has event i: a proxy
                # that buffered the answer would never deliver the first
                for _ in range(decode.events):
                    received.append(await resp.content.readuntil(b"\n\n"))
                    decode.lockstep.put_nowait(None)
                received.append(await resp.content.read())
            assert received == decode.sent
            assert [json.loads(e[6:])["choices"][0]["text"] for e in received[:-1]] == [
                f"decode0 {i}" for i in range(5)
            ]
            assert decode.bodies() == [body]
            prefill_body = {k: v for k, v in body.items() if k != "stream_options"}
            assert r.prefill[0].bodies() == [{**prefill_body, "max_tokens": 1, "stream": False}]

    run(scenario())


def test_connections_to_a_server_are_kept_alive_between_requests() -> None:
    async def scenario() -> None:
        async with rig() as r:
            for body in (COMPLETION, {**COMPLETION, "stream": True}, COMPLETION):
                async with r.client.post(r.proxy.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
            # a handshake per request would cost each one a round trip on both halves
            assert len({s.peer for s in r.prefill[0].seen}) == 1
            assert len({s.peer for s in r.decode[0].seen}) == 1

    run(scenario())


# -- which server --------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_requests_go_to_the_server_with_the_fewest_in_flight(role: str) -> None:
    async def scenario() -> None:
        async with rig(prefill=2, decode=2) as r:
            engines = r.prefill if role == "prefill" else r.decode
            for e in engines:
                e.holding = {"hold"}
            held = asyncio.ensure_future(
                r.post("/v1/completions", {**COMPLETION, "prompt": "hold"})
            )
            await until(lambda: sum(e.prompts().count("hold") for e in engines) == 1, "the hold")
            busy, idle = sorted(engines, key=lambda e: -len(e.seen))
            # one request in flight on `busy`: every new one goes to `idle`, whatever the
            # turn (round-robin alone would send the second to `busy`)
            for i in range(3):
                status, _ = await r.post("/v1/completions", {**COMPLETION, "prompt": f"q{i}"})
                assert status == 200
            assert busy.prompts() == ["hold"]
            assert idle.prompts() == ["q0", "q1", "q2"]
            busy.release.set()
            assert (await held)[0] == 200

    run(scenario())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_concurrent_requests_spread_evenly_over_servers(role: str) -> None:
    async def scenario() -> None:
        async with rig(prefill=3, decode=3) as r:
            engines = r.prefill if role == "prefill" else r.decode
            for e in engines:
                e.holding = {"hold"}
            hold = {**COMPLETION, "prompt": "hold"}
            requests = [asyncio.ensure_future(r.post("/v1/completions", hold)) for _ in range(6)]
            await until(lambda: sum(len(e.seen) for e in engines) == 6, "six requests in flight")
            assert [len(e.seen) for e in engines] == [2, 2, 2]
            during = await r.metrics()
            assert [in_flight(during, role, e.url) for e in engines] == [2, 2, 2]
            for e in engines:
                e.release.set()
            assert [status for status, _ in await asyncio.gather(*requests)] == [200] * 6
            after = await r.metrics()
            assert [in_flight(after, "prefill", e.url) for e in r.prefill] == [0, 0, 0]
            assert [in_flight(after, "decode", e.url) for e in r.decode] == [0, 0, 0]

    run(scenario())


# -- failures -------------------------------------------------------------------------


def test_a_refused_prefill_url_gives_way_to_another() -> None:
    async def scenario() -> None:
        async with rig(dead_prefill=1) as r:
            # equal loads: the first URL is tried first, and refused
            status, answer = await r.post("/v1/completions", COMPLETION)
            assert status == 200 and answer["choices"][0]["text"] == "decode0"
            assert len(r.prefill[0].seen) == 1 and len(r.decode[0].seen) == 1
            m = await r.metrics()
            assert sample(m, "beluga_proxy_errors_total", role="prefill", kind="connect") == 1
            assert completions(m, "ok") == 1

    run(scenario())


def test_a_prefill_server_hanging_up_gives_way_to_another() -> None:
    async def scenario() -> None:
        async with rig(prefill=2) as r:
            for e in r.prefill:
                e.hang_up = True
            status, answer = await r.post("/v1/completions", COMPLETION)
            assert status == 502 and "closed the connection" in answer["error"]["message"]
            assert [len(e.seen) for e in r.prefill] == [1, 1] and not r.decode[0].seen
            r.prefill[1].hang_up = False
            status, answer = await r.post("/v1/completions", COMPLETION)
            assert status == 200 and answer["choices"][0]["text"] == "decode0"
            assert len(r.prefill[1].seen) == 2  # and prefill0 tried again, or not, by turn
            m = await r.metrics()
            hang_ups = sum(len(e.seen) for e in r.prefill) - 1  # all but the one that answered
            errors = sample(m, "beluga_proxy_errors_total", role="prefill", kind="disconnect")
            assert errors == hang_ups

    run(scenario())


def test_a_prefill_answer_that_is_not_json_is_a_502() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.prefill[0].raw_answer = b"<html>gateway</html>"
            status, answer = await r.post("/v1/completions", COMPLETION)
            assert status == 502
            assert r.prefill[0].url in answer["error"]["message"]
            assert "not JSON" in answer["error"]["message"] and not r.decode[0].seen
            m = await r.metrics()
            assert sample(m, "beluga_proxy_errors_total", role="prefill", kind="bad_response") == 1
            assert completions(m, "prefill_error") == 1

    run(scenario())


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
def test_no_server_of_a_role_answering_is_a_502_naming_each_url(role: str, stream: bool) -> None:
    dead = (
        {"dead_prefill": 2, "prefill": 0} if role == "prefill" else {"dead_decode": 2, "decode": 0}
    )

    async def scenario() -> None:
        async with rig(**dead) as r:
            status, answer = await r.post("/v1/completions", {**COMPLETION, "stream": stream})
            assert status == 502
            message = answer["error"]["message"]
            assert all(url in message for url in r.dead) and len(r.dead) == 2
            assert message.count("Connection refused") == 2
            # a prefill that failed sends nothing on; a decode that failed had its prefill
            assert [len(e.seen) for e in r.prefill + r.decode] == [role == "decode"]
            m = await r.metrics()
            assert sample(m, "beluga_proxy_errors_total", role=role, kind="connect") == 2
            assert completions(m, f"{role}_unavailable") == 1

    run(scenario())


def test_a_refused_decode_url_gives_way_to_another() -> None:
    async def scenario() -> None:
        async with rig(dead_decode=1) as r:
            status, answer = await r.post("/v1/completions", {**COMPLETION, "stream": False})
            assert status == 200 and answer["choices"][0]["text"] == "decode0"
            m = await r.metrics()
            assert sample(m, "beluga_proxy_errors_total", role="decode", kind="connect") == 1

    run(scenario())


def test_a_prefill_server_that_never_answers_times_out_as_504() -> None:
    async def scenario() -> None:
        async with rig(timeout=0.5) as r:
            r.prefill[0].holding = {"hold"}
            status, answer = await r.post("/v1/completions", {**COMPLETION, "prompt": "hold"})
            assert status == 504
            assert r.prefill[0].url in answer["error"]["message"]
            assert "0.5 s" in answer["error"]["message"]
            assert not r.decode[0].seen

    run(scenario())


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_error_status_passes_through(role: str, stream: bool) -> None:
    async def scenario() -> None:
        async with rig() as r:
            (r.prefill if role == "prefill" else r.decode)[0].status = 400
            status, answer = await r.post("/v1/completions", {**COMPLETION, "stream": stream})
            assert (status, answer) == (400, ERROR)
            assert len(r.decode[0].seen) == (role == "decode")

    run(scenario())


async def read_stream(r: Rig, body: dict[str, Any]) -> list[bytes]:
    """The events of a streamed answer, to its end (each read bounded by WAIT_S)."""
    async with r.client.post(r.proxy.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        events = []
        while chunk := await resp.content.readuntil(b"\n\n"):
            events.append(chunk)
        return events


@pytest.mark.parametrize("failure", ["closed", "closed-mid-event", "silent"])
def test_a_decode_server_breaking_off_a_stream_ends_it_with_an_error_event(failure: str) -> None:
    async def scenario() -> None:
        async with rig(timeout=0.5) as r:
            decode = r.decode[0]
            if failure == "silent":
                decode.stall_after = 2
            else:
                decode.break_after = 2
            if failure == "closed-mid-event":
                decode.half_event = b'data: {"id": "cmpl-1", "cho'
            events = await read_stream(r, {**COMPLETION, "stream": True})
            # what the engine sent (a half event ended by a blank line), the error, the end
            ended = [decode.half_event + b"\n\n"] if decode.half_event else []
            assert events[:-2] == [*decode.sent[:2], *ended]
            assert events[-1] == b"data: [DONE]\n\n"
            error = json.loads(events[-2].removeprefix(b"data: "))["error"]
            assert decode.url in error["message"] and error["code"] == 502
            reason = "no bytes within 0.5 s" if failure == "silent" else "closed the connection"
            assert reason in error["message"]
            m = await r.metrics()
            assert sample(m, "beluga_proxy_errors_total", role="decode", kind="stream") == 1
            assert completions(m, "stream_broken") == 1
            assert in_flight(m, "decode", decode.url) == 0

    run(scenario())


def test_a_client_leaving_mid_stream_closes_the_decode_request() -> None:
    async def scenario() -> None:
        async with rig() as r:
            decode = r.decode[0]
            decode.endless = True
            resp = await r.client.post(
                r.proxy.url + "/v1/completions", json={**COMPLETION, "stream": True}
            )
            assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: ")
            resp.close()  # the client leaves
            await asyncio.wait_for(decode.left.wait(), WAIT_S)
            m = await r.metrics()
            assert completions(m, "client_gone") == 1
            assert in_flight(m, "decode", decode.url) == 0

    run(scenario())


@pytest.mark.parametrize(
    ("body", "reason"),
    [(b"{not json", "not JSON"), (b"[1, 2]", "JSON object")],
    ids=["not-json", "not-an-object"],
)
def test_a_bad_request_body_is_a_400_and_reaches_no_server(body: bytes, reason: str) -> None:
    async def scenario() -> None:
        async with rig() as r:
            status, answer = await r.post("/v1/chat/completions", body)
            assert status == 400 and reason in answer["error"]["message"]
            assert not r.prefill[0].seen and not r.decode[0].seen
            m = await r.metrics()
            assert sample(m, "beluga_proxy_errors_total", role="client", kind="bad_request") == 1

    run(scenario())


# -- the other routes -----------------------------------------------------------------


def test_a_client_that_never_sends_its_body_gets_a_408() -> None:
    async def scenario() -> None:
        async with rig(timeout=0.5) as r:
            reader, writer = await asyncio.open_connection("127.0.0.1", r.proxy.port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), WAIT_S)
            writer.close()
            await writer.wait_closed()
            assert status_line.split()[1] == b"408"
            assert not r.prefill[0].seen and not r.decode[0].seen

    run(scenario())


def test_models_is_forwarded_health_answers_and_unknown_routes_are_json_404() -> None:
    async def scenario() -> None:
        async with rig() as r:
            async with r.client.get(
                r.proxy.url + "/v1/models", headers={"Authorization": "Bearer key-2"}
            ) as resp:
                assert (resp.status, await resp.json()) == (200, MODELS)
            assert [s.path for s in r.decode[0].seen] == ["/v1/models"]
            assert r.decode[0].seen[0].headers["Authorization"] == "Bearer key-2"
            status, text = await r.get("/health")
            assert status == 200
            health = json.loads(text)
            assert health["status"] == "ok"
            assert health["in_flight"]["decode"] == {r.decode[0].url: 0}
            status, text = await r.get("/v1/embeddings")
            assert status == 404 and "/v1/embeddings" in json.loads(text)["error"]["message"]

    run(scenario())


def test_metrics_count_requests_errors_and_latencies() -> None:
    async def scenario() -> None:
        async with rig() as r:
            for _ in range(2):
                assert (await r.post("/v1/completions", COMPLETION))[0] == 200
            async with r.client.post(
                r.proxy.url + "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as resp:
                assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
            r.prefill[0].status = 400
            assert (await r.post("/v1/completions", COMPLETION))[0] == 400
            m = await r.metrics()
            p, d = r.prefill[0].url, r.decode[0].url
            assert completions(m, "ok") == 2
            assert sample(m, REQUESTS, route="/v1/chat/completions", outcome="ok") == 1
            assert completions(m, "prefill_error") == 1
            assert sample(m, "beluga_proxy_errors_total", role="prefill", kind="status") == 1
            # a latency for each answered half: the failed prefill has none
            assert sample(m, "beluga_proxy_prefill_seconds_count", server=p) == 3
            assert sample(m, "beluga_proxy_decode_seconds_count", server=d) == 3
            assert sample(m, "beluga_proxy_prefill_seconds_bucket", server=p, le="+Inf") == 3
            assert len(r.prefill[0].seen) == 4 and len(r.decode[0].seen) == 3

    run(scenario())


# -- the Python API and the command ------------------------------------------------------


def test_server_urls_split_commas_and_refuse_malformed_ones() -> None:
    assert server_urls(["http://a:8100/, http://b:8100", "https://c"], "decode") == [
        "http://a:8100",
        "http://b:8100",
        "https://c",
    ]
    assert server_urls("http://[::1]:8100", "prefill") == ["http://[::1]:8100"]
    for bad, words in [
        ("", "--decode needs at least one"),
        ("localhost:8100", "root URL"),
        ("ftp://a:1", "root URL"),
        ("http://a:8100/v1", "without a path"),
        ("http://a:99999", "root URL"),
        ("http://a:1,http://a:1", "more than once"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            server_urls(bad, "decode")


def test_a_port_in_use_is_a_clear_error() -> None:
    async def scenario() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            proxy = ProxyServer("http://127.0.0.1:1", "http://127.0.0.1:2", port=port)
            with pytest.raises(BelugaError, match="--port"):
                await proxy.start()
            await proxy.close()

    run(scenario())


def beluga(*args: str) -> list[str]:
    return [sys.executable, "-m", "beluga", "proxy", *args]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_command_serves_on_a_free_port_and_stops_on_a_signal(sig: signal.Signals) -> None:
    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            prefill, decode = (
                await FakeEngine("prefill0").start(),
                await FakeEngine("decode0").start(),
            )
            stack.push_async_callback(prefill.close)
            stack.push_async_callback(decode.close)
            args = beluga(
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            )
            proc = await asyncio.create_subprocess_exec(
                *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            try:
                line = (await asyncio.wait_for(proc.stdout.readline(), WAIT_S * 3)).decode()
                found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
                assert found and int(found.group(1)) > 0, line
                timeout = aiohttp.ClientTimeout(total=WAIT_S)
                async with (
                    aiohttp.ClientSession(timeout=timeout) as client,
                    client.post(found.group(0) + "/v1/completions", json=COMPLETION) as resp,
                ):
                    assert resp.status == 200
                    assert (await resp.json())["choices"][0]["text"] == "decode0"
                assert prefill.bodies() == [{**COMPLETION, "max_tokens": 1, "stream": False}]
                proc.send_signal(sig)
                _, err = await asyncio.wait_for(proc.communicate(), WAIT_S)
                assert proc.returncode == 0, err.decode()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    run(scenario())


def test_the_command_exits_non_zero_with_one_line_on_bad_arguments() -> None:
    done = subprocess.run(
        beluga("--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200"),
        capture_output=True,
        text=True,
        timeout=WAIT_S * 3,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("beluga: error: --prefill")
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--decode", "http://d:1"], "--prefill needs at least one"),
        (["--prefill", "http://p:1"], "--decode needs at least one"),
        (["--prefill", "http://p:1", "--decode", ""], "--decode needs at least one"),
        (["--prefill", "http://p:1", "--decode", "http://d:1/v1"], "without a path"),
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--port", "70000"], "--port"),
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--timeout", "0"], "--timeout"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["proxy", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("beluga: error: ") and words in err
