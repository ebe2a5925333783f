"""A synthetic long-context trace in the spirit of LV-Eval.

LV-Eval asks many questions about each of a few long documents, so most of
every prompt is a document that other prompts share.  Here each document is
``context_tokens`` seeded random token ids, each question is a short seeded
run of tokens appended to it, the number of questions varies by document
(some documents are hotter than others, as in any real trace), and the
requests arrive in a seeded random order.  Token ids stand in for text: the
model has random weights, so only the sharing pattern and the lengths matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    """One prompt: a document followed by a question about it."""

    id: int
    document: int
    question: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceShape:
    """How big the trace is; every field is checked."""

    documents: int = 4
    min_questions: int = 2
    max_questions: int = 6
    context_tokens: int = 4096
    min_question_tokens: int = 16
    max_question_tokens: int = 48

    def __post_init__(self) -> None:
        for name in ("documents", "min_questions", "context_tokens", "min_question_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"TraceShape.{name} must be >= 1, not {getattr(self, name)}")
        if self.max_questions < self.min_questions:
            raise ValueError("TraceShape.max_questions must be >= min_questions")
        if self.max_question_tokens < self.min_question_tokens:
            raise ValueError("TraceShape.max_question_tokens must be >= min_question_tokens")

    @property
    def max_prompt_tokens(self) -> int:
        return self.context_tokens + self.max_question_tokens


def lv_eval_trace(shape: TraceShape, vocab_size: int, seed: int = 0) -> list[TraceRequest]:
    """The requests of one pass, in arrival order; the same seed gives the same trace."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, not {vocab_size}")
    rng = np.random.default_rng(seed)
    requests = []
    for doc in range(shape.documents):
        context = rng.integers(0, vocab_size, shape.context_tokens).tolist()
        for q in range(int(rng.integers(shape.min_questions, shape.max_questions + 1))):
            n = int(rng.integers(shape.min_question_tokens, shape.max_question_tokens + 1))
            question = rng.integers(0, vocab_size, n).tolist()
            requests.append((doc, q, tuple(context + question)))
    order = rng.permutation(len(requests))
    return [TraceRequest(i, *requests[j]) for i, j in enumerate(order.tolist())]
