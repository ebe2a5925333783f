"""Fixtures for the framework tests: a pool with its metadata server, in this process, and
tiny models for the vLLM connector's tests.

These tests run inside the frameworks' own virtualenvs (ci/run-framework-tests.sh);
in the main environment each module skips at import, naming the install step.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from beluga.kv import KVStore
from beluga.pool import Geometry, Pool
from beluga.server import MetadataServer

SETUP = "bash ci/install-frameworks.sh && bash ci/run-framework-tests.sh"


def need(module: str, venv: str) -> None:
    """Skip the calling test module unless ``module`` imports (it lives in the venv ``venv``)."""
    pytest.importorskip(module, reason=f"needs the {venv} virtualenv: {SETUP}")


@pytest.fixture
def served_pool(shm_path: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A 64 MiB pool with a running metadata server; yields its path.

    The frameworks' caches keep what they saved, as in service, so the tests
    using it leave keys (tests/conftest.py still checks for writes in flight).
    """
    request.node.add_marker(pytest.mark.leaves("keys"))
    pool = Pool.create(shm_path, 64 << 20, geometry=Geometry(max_hosts=8, block_size=16 << 10))
    server = MetadataServer(pool)
    thread = server.start_thread()
    yield shm_path
    server.stop()
    thread.join(timeout=10)
    server.close()
    pool.close()
    Pool.destroy(shm_path)


@pytest.fixture(scope="session")
def llamas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny random Llama at two paths (two hosts), a fine-tune in a directory of the same
    name, and one whose directory holds its config alone (the vLLM connector's tests)."""
    from tests.frameworks.vllm_rig import tiny_llama  # it imports vLLM: only its tests ask

    root = tmp_path_factory.mktemp("models")
    return {
        "base": tiny_llama(root / "host-1" / "llama", seed=0),
        "copy": tiny_llama(root / "host-2" / "llama", seed=0),
        "fine-tune": tiny_llama(root / "fine-tune" / "llama", seed=1),
        "config-only": tiny_llama(root / "config-only" / "llama", seed=None),
    }


@pytest.fixture(scope="session")
def model_dir(llamas: dict[str, str]) -> str:
    """Enough for vLLM's ModelConfig, nothing downloaded."""
    return llamas["base"]


def write_model(path: Path, seed: int) -> str:
    """A tiny model directory (config.json, model.safetensors) with seeded random weights.

    Written by hand, because not every framework venv has transformers; the
    weights are only ever fingerprinted, never run.  Two seeds stand for a
    model and its fine-tune.
    """
    import torch

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "embed_tokens.weight": torch.randn(64, 32, generator=gen),
        "layers.0.k_proj.weight": torch.randn(32, 32, generator=gen),
        "layers.1.k_proj.weight": torch.randn(32, 32, generator=gen),
    }
    header: dict[str, object] = {}
    data = b""
    for name, tensor in tensors.items():
        raw = tensor.numpy().tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(tensor.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    encoded = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)
    return str(path)


def corrupt(pool: str, key: bytes, at: int) -> None:
    """Flip byte ``at`` of ``key``'s committed payload, as a faulty or hostile host would.

    The byte is written through another attachment of the pool, past every
    protocol (a non-temporal store and a fence), after the value was sealed
    and committed; the store's own validated read must then miss the key.
    """
    with KVStore(pool) as store:
        (ref,) = store.locate([key], prefix=False)
        value = store.get(key)
    assert ref is not None and value is not None and 0 <= at < len(value)
    with Pool.attach(pool) as hostile:
        hostile.memory.nt_store(ref.payload_offset + at, bytes([value[at] ^ 0xFF]))
        hostile.memory.sfence()
    with KVStore(pool) as store:
        assert store.get(key) is None, "the corruption did not land"
