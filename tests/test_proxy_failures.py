"""beluga proxy, failures: servers refusing, hanging up, answering wrong or not at all,
streams broken off, clients leaving or sending bad bodies.

The rig (fake engines, the proxy, a client) is tests/proxy_rig.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.proxy_rig import COMPLETION, ERROR, WAIT_S, Rig, completions, in_flight, rig, run, sample

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
