"""One vLLM engine serving a list of prompts, run inside the vLLM (CPU) virtualenv.

``python -m beluga.bench.vllm_engine JOB.json OUT.json`` starts one ``LLM()``
(on the CPU backend: eager mode, in-process engine core), with
``BelugaConnector`` when the job names a pool, and drives its ``LLMEngine``
step by step with at most ``concurrency`` requests in flight: a request
arrives (is added) as soon as one in flight finishes, and its time to first
token runs from its arrival to the step that returns its first token.  With
``concurrency`` 1 each request is served alone.  It writes what each request
produced: token ids, vLLM's count of cached prompt tokens, its TTFT and total
seconds, and the connector's load seconds and blocks counted while it was in
flight (its own alone when served one at a time); and the seconds the whole
list took (``wall_s``).  ``beluga bench vllm`` and
tests/frameworks start engines this way, one process per engine, because one
process holds one engine and each engine stands for one host.

A job is a JSON object: ``model`` (a directory, see :func:`write_tiny_model`),
``prompts`` (lists of token ids), ``max_tokens``, and optionally
``concurrency`` (default 1), ``warmup`` (prompts served first, one at a time,
and not reported: the first request of an engine pays one-time costs),
``pool`` (a spec; absent: plain vLLM), ``extra`` (more
kv_connector_extra_config), ``block_size`` (default 32, what the CPU attention
needs), ``dtype``.  The connector's counters in the output are counted from
the end of the warm-up to the end of the last request's saves (which run on
after its last token: see :func:`drain`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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


def write_tokenizer(path: str, vocab_size: int) -> str:
    """A word-level tokenizer for a :func:`write_tiny_model` model, so ``vllm serve`` can serve
    text: token ``i`` is the word ``w{i}`` (ids 0-2 are <unk>, <s>, </s>), and a chat turns
    into its messages' words.  Text of ``w`` words is then exactly those token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    return path


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Serve the job's prompts on a fresh engine; the results, one per prompt."""
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.sampling_params import RequestOutputKind

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
    params = SamplingParams(
        max_tokens=job["max_tokens"],
        temperature=0.0,
        detokenize=False,
        output_kind=RequestOutputKind.CUMULATIVE,  # an output every step: the first token's too
    )
    serve(llm.llm_engine, job.get("warmup", []), params, 1, connector.counters)
    before, start = connector.counters(), time.perf_counter()
    results = serve(
        llm.llm_engine, job["prompts"], params, job.get("concurrency", 1), connector.counters
    )
    wall = time.perf_counter() - start
    drain(llm.llm_engine)
    after = connector.counters()
    llm.llm_engine.engine_core.shutdown()  # TP workers unlink their message queues' memory
    return {
        "startup_s": startup,
        "wall_s": wall,
        "results": results,
        "counters": {name: after[name] - before[name] for name in after},
    }


#: seconds :func:`drain` waits for the last saves
DRAIN_TIMEOUT_S = 120.0


@dataclass
class _InFlight:
    """A request between its arrival and its last token."""

    index: int  # in the trace
    arrival: float
    counters: dict[str, float]  # the connector's, at arrival
    ttft: float | None = None


def serve(
    engine: Any,
    prompts: list[list[int]],
    params: Any,
    concurrency: int,
    counters: Callable[[], dict[str, float]],
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict[str, Any]]:
    """Drive ``engine`` (an ``LLMEngine``) with at most ``concurrency`` prompts in flight.

    A prompt arrives as soon as the trace has one and fewer than
    ``concurrency`` are in flight; the results, in trace order.
    ``counters``: the connector's totals now; ``clock``: seconds now.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    results: list[dict[str, Any]] = [{} for _ in prompts]
    waiting = list(enumerate(prompts))[::-1]  # popped from the end: trace order
    in_flight: dict[str, _InFlight] = {}
    while waiting or in_flight:
        while waiting and len(in_flight) < concurrency:
            index, ids = waiting.pop()
            request_id = f"trace-{index}"  # outputs carry it (vLLM adds a suffix inside)
            arrival = clock()
            engine.add_request(request_id, {"prompt_token_ids": ids}, params)  # a TokensPrompt
            in_flight[request_id] = _InFlight(index, arrival, counters())
        for out in engine.step():
            now = clock()
            flight = in_flight[out.request_id]
            if flight.ttft is None and out.outputs[0].token_ids:
                flight.ttft = now - flight.arrival
            if out.finished:
                del in_flight[out.request_id]
                results[flight.index] = _result(out, flight, now, counters())
    return results


def drain(engine: Any, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Step ``engine`` until its scheduler holds no finished request's blocks.

    A request is finished when its last token is out, but the connector may
    still be saving its blocks (vLLM frees them once the save is reported
    done), so counters read before then miss those saves.  Raises
    ``TimeoutError`` after ``timeout_s``.
    """
    scheduler = getattr(getattr(engine.engine_core, "engine_core", None), "scheduler", None)
    if scheduler is None:  # not an in-process engine core: nothing to look at
        return
    deadline = time.monotonic() + timeout_s
    while scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine still held finished requests after {timeout_s} s")
        engine.step()
        time.sleep(0.001)


def _result(
    out: Any, flight: _InFlight, finished: float, counters: dict[str, float]
) -> dict[str, Any]:
    """What one finished request reports (``counters``: the connector's, now)."""
    return {
        "tokens": list(out.outputs[0].token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "ttft_seconds": flight.ttft,
        "seconds": finished - flight.arrival,
        "load_seconds": counters["load_seconds"] - flight.counters["load_seconds"],
        "loaded_blocks": counters["loaded_blocks"] - flight.counters["loaded_blocks"],
    }


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
