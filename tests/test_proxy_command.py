"""beluga proxy: the Python API (server URLs, a port in use) and the ``beluga proxy`` command.

The rig (fake engines, the proxy, a client) is tests/proxy_rig.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest

from beluga.cli import main
from beluga.errors import BelugaError
from beluga.serving.proxy import ProxyServer, server_urls
from tests.proxy_rig import COMPLETION, WAIT_S, FakeEngine, run

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
