"""beluga proxy, routing: what each server is sent, which server, and the other routes.

The rig (fake engines, the proxy, a client) is tests/proxy_rig.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.proxy_rig import (
    CHAT,
    COMPLETION,
    MODELS,
    REQUESTS,
    WAIT_S,
    completions,
    in_flight,
    rig,
    run,
    sample,
    until,
)

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
