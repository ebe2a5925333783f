"""The settings of an end-to-end experiment: the model, the trace, the engines, the arrivals.

:class:`Settings` checks itself on construction and derives what the engines
build (the KV block format, a GPU engine's memory budget) and the trace each
pass replays.  Model sizes (:data:`MODELS`) are described in
:mod:`beluga.bench.e2e`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from beluga.serving.cluster import EngineConfig, check_gpu_budget, gpu_bytes
from beluga.serving.engine import KV_ORDER
from beluga.serving.model import DTYPES, QWEN2_7B, ModelShape, engine_memory_bytes
from beluga.serving.scheduler import SCHEDULERS
from beluga.serving.trace import (
    LV_EVAL_15K,
    TraceRequest,
    TraceShape,
    in_bursts,
    lv_eval_trace,
    poisson_arrivals,
)
from beluga.transfer import BlockFormat

MODELS = {
    "tiny": ModelShape(max_positions=16384),
    "small": ModelShape(
        num_layers=8,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1408,
        max_positions=16384,
    ),
    "wide-kv": ModelShape(
        num_layers=12,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=1408,
        max_positions=16384,
    ),
    "7b": QWEN2_7B,
}


GPU_ONLY = {"7b"}  # a CPU would take minutes a prefill
#: the documents' tokens when the command line names none
CONTEXT_TOKENS = {"7b": LV_EVAL_15K.context_tokens}
DEFAULT_CONTEXT_TOKENS = 4096
WARMUP_TOKENS = 64


@dataclass(frozen=True)
class Settings:
    """One end-to-end experiment."""

    model: str = "small"
    trace: TraceShape = field(default_factory=TraceShape)
    engines: int = 2
    schedulers: tuple[str, ...] = ("locality-free", "locality-aware")
    seed: int = 0
    rate: float | None = 0.0  # requests/s (Poisson); 0: all at once; None: below saturation
    threads: int = 1  # torch threads per engine
    start_method: str = "spawn"
    device: str = "cpu"  # "cuda": engines run the model, and move KV, on the GPU
    dtype: str | None = None  # of weights and KV; None: bfloat16 on a GPU, float32 on the CPU
    repeat: int = 1  # runs from scratch; rows are medians over them
    capacity: int | None = None  # bytes of KV a store may hold; None: derived from the trace
    burst: int = 1  # each document's first `burst` questions arrive at once
    pd: tuple[int, int] | None = None  # (prefill, decode) engines: disaggregated (e2e_pd)
    max_tokens: int = 16  # tokens a decode engine generates per request

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose from {sorted(MODELS)}")
        unknown = [s for s in self.schedulers if s not in SCHEDULERS]
        if unknown or not self.schedulers:
            raise ValueError(f"schedulers must be some of {sorted(SCHEDULERS)}, not {unknown}")
        if self.model in GPU_ONLY and not self.on_gpu:
            raise ValueError(
                f"model {self.model!r} runs on a GPU (--device cuda); on the CPU use one of "
                f"{sorted(set(MODELS) - GPU_ONLY)}"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.rate is not None and self.rate < 0:
            raise ValueError(f"rate must be >= 0 requests/s (or None: automatic), not {self.rate}")
        if self.engines < 1 or self.threads < 1:
            raise ValueError("engines and threads must be >= 1")
        if self.repeat < 1 or self.burst < 1 or self.max_tokens < 1:
            raise ValueError("repeat, burst and max_tokens must be >= 1")
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"capacity must be a positive number of bytes, not {self.capacity}")
        if self.pd is not None and (min(self.pd) < 1 or sum(self.pd) != self.engines):
            raise ValueError(
                f"pd must be (prefill, decode) engines, each >= 1, {self.engines} in all; "
                f"not {self.pd}"
            )
        generated = self.max_tokens if self.pd is not None else 0
        if self.trace.max_prompt_tokens + generated > MODELS[self.model].max_positions:
            raise ValueError(
                f"prompts of up to {self.trace.max_prompt_tokens} tokens (and {generated} "
                f"generated) exceed model {self.model!r}'s {MODELS[self.model].max_positions} "
                "positions; use shorter contexts"
            )

    @property
    def shape(self) -> ModelShape:
        return MODELS[self.model]

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def kv_dtype(self) -> str:
        """The engines' dtype: ``dtype``, else bfloat16 on a GPU and float32 on the CPU."""
        return self.dtype or ("bfloat16" if self.on_gpu else "float32")

    @property
    def format(self) -> BlockFormat:
        return BlockFormat(self.shape.kv_spec(self.kv_dtype), KV_ORDER)

    @property
    def memory_bytes(self) -> int | None:
        """Each GPU engine's memory budget (None on the CPU): its longest prompt, and with
        prefill/decode disaggregation the tokens it generates."""
        if not self.on_gpu:
            return None
        generated = self.max_tokens if self.pd is not None else 0
        tokens = max(self.trace.max_prompt_tokens + generated, WARMUP_TOKENS)
        return engine_memory_bytes(self.shape, self.kv_dtype, tokens)

    def engine_config(self) -> EngineConfig:
        """What every engine process builds."""
        return EngineConfig(
            self.shape,
            seed=self.seed,
            threads=self.threads,
            device=self.device,
            dtype=self.kv_dtype,
            memory_bytes=self.memory_bytes,
        )

    def check_gpu(self, engines: int) -> None:
        """Refuse ``engines`` engines of these settings at once on the GPU when their memory
        budgets do not fit there (nothing to check on the CPU)."""
        if self.memory_bytes is not None:
            check_gpu_budget(self.memory_bytes, engines, gpu_bytes(self.device), self.device)

    @property
    def roles(self) -> list[str] | None:
        """Each engine's role when disaggregated: the prefill engines, then the decode ones."""
        if self.pd is None:
            return None
        return ["kv_producer"] * self.pd[0] + ["kv_consumer"] * self.pd[1]

    def requests(self) -> list[TraceRequest]:
        """The trace each pass replays, in arrival order."""
        return self._bursts()[0]

    def arrivals(self, seed: int) -> list[float]:
        """When each request arrives, in seconds from the start of a pass (an automatic rate
        must have been measured: :func:`with_rate`)."""
        if self.rate is None:
            raise ValueError("the rate is automatic: measure it first (beluga.bench.e2e.with_rate)")
        groups = self._bursts()[1]
        return poisson_arrivals(len(groups), self.rate, seed, groups)

    def _bursts(self) -> tuple[list[TraceRequest], list[int]]:
        return in_bursts(lv_eval_trace(self.trace, self.shape.vocab_size, self.seed), self.burst)
