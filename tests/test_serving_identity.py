"""Model identity: which weights a KV block belongs to, and the key namespaces built on it.

Models are small transformers Llamas and Qwen2s with seeded random weights,
in memory (:meth:`ModelIdentity.of_module`) or saved as a Hugging Face
directory (:meth:`ModelIdentity.of_files`); a Hugging Face cache is faked in
a temporary directory.  Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from beluga.errors import KVLayoutError
from beluga.kv import KVNamespace, ModelIdentity, block_keys, prefix_hashes, resolve_model
from beluga.kv import identity as identity_module
from beluga.serving.engine import ServingEngine, create_kv_pool, kv_format, kv_geometry
from beluga.serving.engine import kv_pool_size as pool_size
from beluga.serving.model import ModelEngine, ModelShape

SHAPE = ModelShape(num_layers=2)
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SETTING = "the 'model_revision' option"


def llama(seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def save(model: LlamaForCausalLM, path: Path) -> str:
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One Llama saved twice (two hosts' paths), and a fine-tune under the same directory name."""
    root = tmp_path_factory.mktemp("models")
    base = llama(seed=0)
    return {
        "host-1": save(base, root / "host-1" / "llama"),
        "host-2": save(base, root / "host-2" / "llama"),
        "fine-tune": save(llama(seed=1), root / "fine-tune" / "llama"),
    }


# -- of_module -----------------------------------------------------------------


def test_models_in_memory_are_told_apart_by_weights_and_config() -> None:
    qwen = ModelEngine(SHAPE, seed=5)
    assert qwen.identity == ModelEngine(SHAPE, seed=5).identity  # one seed, one model
    assert qwen.identity != ModelEngine(SHAPE, seed=6).identity  # a fine-tune
    assert qwen.identity != ModelEngine(ModelShape(family="llama", num_layers=2), seed=5).identity
    base = llama(seed=0)
    rope = llama(seed=0)
    rope.config.rope_parameters = {"rope_type": "default", "rope_theta": 5e5}
    assert ModelIdentity.of_module(base) != ModelIdentity.of_module(rope)  # same weights
    assert ModelIdentity.of_module(base).name == "llama"


def test_a_change_to_one_tensor_changes_the_fingerprint() -> None:
    model = llama(seed=0)
    before = ModelIdentity.of_module(model)
    with torch.no_grad():
        model.lm_head.weight.add_(1e-3)  # fine-tuning the head alone
    assert ModelIdentity.of_module(model) != before


# -- of_files ------------------------------------------------------------------


def test_files_are_fingerprinted_by_content_not_path(saved: dict[str, str]) -> None:
    one, two, tuned = (ModelIdentity.of_files(saved[k]) for k in ("host-1", "host-2", "fine-tune"))
    assert one == two  # the same files mounted elsewhere: blocks are shared
    assert one != tuned  # same directory name, other weights: never shared
    assert one.fingerprint.startswith("files:") and one.name == "llama"
    weights = os.path.join(saved["host-1"], "model.safetensors")
    assert ModelIdentity.of_files(weights) != one  # a single weights file: its own identity


def test_a_fine_tune_of_one_tensor_on_disk_is_another_model(
    saved: dict[str, str], tmp_path: Path
) -> None:
    model = llama(seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.01)  # the smallest tensor: 64 values
    assert ModelIdentity.of_files(save(model, tmp_path / "llama")) != ModelIdentity.of_files(
        saved["host-1"]
    )


def test_a_config_change_alone_is_another_model(saved: dict[str, str], tmp_path: Path) -> None:
    copy = shutil.copytree(saved["host-1"], tmp_path / "llama")
    config = json.loads((copy / "config.json").read_text())
    config["rope_theta"] = 123456.0
    (copy / "config.json").write_text(json.dumps(config))
    assert ModelIdentity.of_files(str(copy)) != ModelIdentity.of_files(saved["host-1"])


def test_fingerprinting_reads_a_sample_not_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 GiB safetensors file (sparse: nothing is written) costs a few KiB of reads."""
    tensor = 1 << 28  # 256 MiB each
    layout = {
        f"t{i}": {
            "dtype": "F32",
            "shape": [1 << 20, 64],
            "data_offsets": [i * tensor, (i + 1) * tensor],
        }
        for i in range(4)
    }
    header = json.dumps(layout).encode()
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + 4 * tensor)
    read = []
    real_pread = os.pread

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        read.append(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(identity_module.os, "pread", counting_pread)
    ModelIdentity.of_files(str(tmp_path))
    assert sum(read) < 64 << 10


def test_hugging_face_snapshots_are_named_by_their_commit(
    saved: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    snapshot = shutil.copytree(saved["host-1"], repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    exact = ModelIdentity(f"hf:acme/tiny-llama@{COMMIT}", "acme/tiny-llama")
    assert ModelIdentity.of_files(str(snapshot)) == exact
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert ModelIdentity.of_files("acme/tiny-llama") == exact
    assert ModelIdentity.of_files("acme/tiny-llama", "main") == exact
    assert ModelIdentity.of_files("acme/tiny-llama", COMMIT).name == "acme/tiny-llama"
    with pytest.raises(LookupError, match="revision 'v2'"):
        ModelIdentity.of_files("acme/tiny-llama", "v2")
    with pytest.raises(LookupError, match="not a local path"):
        ModelIdentity.of_files("acme/other-model")
    shutil.copytree(snapshot, repo / "snapshots" / COMMIT.replace("0", "f"))
    assert ModelIdentity.of_files("acme/tiny-llama", "main") == exact
    with pytest.raises(LookupError, match="2 snapshots"):  # and the revision is not known
        ModelIdentity.of_files("acme/tiny-llama")
    with pytest.raises(KVLayoutError, match=SETTING):
        resolve_model("acme/tiny-llama", setting=SETTING)


# -- resolve_model -------------------------------------------------------------


def test_resolve_model_prefers_an_explicit_revision(saved: dict[str, str]) -> None:
    explicit = resolve_model(saved["host-1"], explicit_revision="v1", setting=SETTING)
    assert explicit == ModelIdentity.explicit("llama", "v1")
    assert explicit != resolve_model(saved["host-1"], setting=SETTING)
    assert resolve_model(saved["fine-tune"], explicit_revision="v1", setting=SETTING) == explicit
    by_path = resolve_model("served-name", path=saved["host-1"], setting=SETTING)
    assert by_path == ModelIdentity.of_files(saved["host-1"])


def test_unidentifiable_models_are_refused_naming_the_setting(tmp_path: Path) -> None:
    LlamaConfig(num_hidden_layers=1).save_pretrained(tmp_path)  # a config.json alone
    for model in (str(tmp_path), "no/such-model", None):
        with pytest.raises(KVLayoutError, match=SETTING):
            resolve_model(model, setting=SETTING)
    with pytest.raises(ValueError, match="name and a revision"):
        ModelIdentity.explicit("", "v1")


# -- namespaces and block keys -------------------------------------------------


def test_namespaces_keep_models_layouts_and_scopes_apart() -> None:
    a, b = ModelIdentity.explicit("m", "1"), ModelIdentity.explicit("m", "2")
    spaces = [
        KVNamespace(a, "L2H2D32B16"),
        KVNamespace(b, "L2H2D32B16"),
        KVNamespace(a, "L2H2D32B32"),
        KVNamespace(a, "L2H2D32B16", ("tenant-1",)),
    ]
    assert len({s.digest for s in spaces}) == 4
    assert KVNamespace(ModelIdentity(a.fingerprint, "other name"), "L2H2D32B16") == spaces[0]
    assert spaces[0].key(b"k") == spaces[0].digest + b"k"
    long = spaces[0].key("x" * 300)
    assert len(long) == 48 and long != spaces[0].key("x" * 299)


def test_block_keys_are_prefix_hashes_in_a_namespace() -> None:
    tokens = list(range(40))
    space = KVNamespace(ModelIdentity.explicit("m", "1"), "layout")
    keys = block_keys(tokens, space, 16, seed="s")
    assert keys == [space.key(h) for h in prefix_hashes(tokens, 16, seed="s")]
    other = block_keys(tokens, KVNamespace(ModelIdentity.explicit("m", "2"), "layout"), 16)
    assert len(keys) == 2 and not set(keys) & set(other)
    with pytest.raises(TypeError, match="KVNamespace"):
        block_keys(tokens, 16)  # type: ignore[arg-type]


@pytest.mark.leaves("keys")
def test_an_explicit_identity_overrides_the_fingerprint(shm_path: str) -> None:
    """Two engines told they serve one revision share blocks: the user vouches for the weights."""
    from beluga.kv import KVStore
    from beluga.pool import Pool
    from beluga.server import MetadataServer

    model = ModelEngine(SHAPE, seed=5)
    fmt = kv_format(model)
    pool = create_kv_pool(shm_path, pool_size(16, kv_geometry(fmt)), fmt)
    server = MetadataServer(pool)
    thread = server.start_thread()
    try:
        with KVStore(shm_path) as store:
            named = ModelIdentity.explicit("qwen2-tiny", "r1")
            tokens = list(range(3 * SHAPE.block_tokens + 1))
            ServingEngine(model, store, identity=named).serve(tokens)
            plain = ServingEngine(model, store)
            assert plain.identity == model.identity != named
            assert plain.serve(tokens).cached_tokens == 0
            same = ServingEngine(ModelEngine(SHAPE, seed=5), store, identity=named)
            assert same.serve(tokens).cached_tokens == 3 * SHAPE.block_tokens
    finally:
        server.stop()
        thread.join(10)
        server.close()
        pool.close()
        Pool.destroy(shm_path)
