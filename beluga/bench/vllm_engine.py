"""One vLLM engine serving a list of prompts, run inside the vLLM (CPU) virtualenv.

``python -m beluga.bench.vllm_engine JOB.json OUT.json`` starts one ``LLM()``
(on the CPU backend: eager mode, in-process engine core), with
``BelugaConnector`` when the job names a pool, serves the prompts one at a time
(so a request's wall time with ``max_tokens=1`` is its time to first token),
and writes what each produced: token ids, vLLM's count of cached prompt tokens,
seconds, and the connector's load seconds.  ``beluga bench vllm`` and
tests/frameworks start engines this way, one process per engine, because one
process holds one engine and each engine stands for one host.

A job is a JSON object: ``model`` (a directory, see :func:`write_tiny_model`),
``prompts`` (lists of token ids), ``max_tokens``, and optionally ``pool`` (a
spec; absent: plain vLLM), ``extra`` (more kv_connector_extra_config),
``block_size`` (default 32, what the CPU attention needs), ``dtype``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for a tiny model
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: one process, one host
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


#: model shapes: "tiny" for tests (KV of 4 KiB per 32-token block per layer pair), "small" for
#: benchmarks (prefill long enough to be worth skipping)
MODELS = {
    "tiny": dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    ),
    "small": dict(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    ),
}  # fmt: skip


def write_tiny_model(
    path: str, *, size: str = "tiny", dtype: str = "bfloat16", seed: int = 0
) -> str:
    """A seeded random-weight Llama of a :data:`MODELS` shape in ``path``; nothing downloaded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODELS[size], max_position_embeddings=4096, torch_dtype=dtype)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(path)
    return path


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Serve the job's prompts on a fresh engine; the results, one per prompt."""
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from beluga.integrations import vllm as connector

    options: dict[str, Any] = {}
    if job.get("pool"):
        options["kv_transfer_config"] = KVTransferConfig(
            kv_connector="BelugaConnector",
            kv_connector_module_path="beluga.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"pool": job["pool"], **job.get("extra", {})},
        )
    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=job.get("block_size", 32),
        dtype=job.get("dtype", "bfloat16"),
        seed=0,
        **options,
    )
    startup = time.perf_counter() - start
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, detokenize=False)
    results = []
    for ids in job["prompts"]:
        before = connector.counters()
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = connector.counters()
        results.append(
            {
                "tokens": list(out.outputs[0].token_ids),
                "num_cached_tokens": out.num_cached_tokens,
                "seconds": seconds,
                "load_seconds": after.get("load_seconds", 0.0) - before.get("load_seconds", 0.0),
                "loaded_blocks": after.get("loaded_blocks", 0) - before.get("loaded_blocks", 0),
            }
        )
    return {"startup_s": startup, "results": results, "counters": connector.counters()}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m beluga.bench.vllm_engine JOB.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    result = run(job)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
