"""A synthetic long-context trace in the spirit of LV-Eval.

LV-Eval asks many questions about each of a few long documents, so most of
every prompt is a document that other prompts share.  Here each document is
``context_tokens`` seeded random token ids, each question is a short seeded
run of tokens appended to it, the number of questions varies by document
(some documents are hotter than others, as in any real trace), and the
requests arrive in a seeded random order.  Token ids stand in for text: the
model has random weights, so only the sharing pattern and the lengths matter.

:data:`LV_EVAL_15K` is the paper's setting: documents of 15,000 tokens (937
engine blocks of 16, what the paper's hits move), as LV-Eval's 16K level
holds, with a few short questions each.  The default :class:`TraceShape`
(4,096-token documents) is for CPU engines.

:func:`poisson_arrivals` spaces the requests in time (or lets them all arrive
at once); :func:`in_bursts` turns the start of each document into a burst:
its first questions arrive together, as when many users ask about a document
that has just come in, so that engines routed by load alone compute the same
blocks at the same time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

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


LV_EVAL_15K = TraceShape(
    documents=4,
    min_questions=2,
    max_questions=4,
    context_tokens=15_000,
    min_question_tokens=16,
    max_question_tokens=64,
)
"""Documents of 15,000 tokens, as the paper's LV-Eval prompts (longer than 15K tokens)."""


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


def in_bursts(trace: Sequence[TraceRequest], size: int) -> tuple[list[TraceRequest], list[int]]:
    """The trace with each document's first ``size`` requests moved up to the first one's
    place (ids renumbered in the new order), and each request's burst number: the requests
    of one burst arrive at once (:func:`poisson_arrivals` with ``groups``)."""
    if size < 1:
        raise ValueError(f"a burst is at least 1 request, not {size}")
    by_document: dict[int, list[TraceRequest]] = {}
    for r in trace:
        by_document.setdefault(r.document, []).append(r)
    taken: set[int] = set()
    ordered: list[TraceRequest] = []
    groups: list[int] = []
    for r in trace:
        if r.id in taken:
            continue
        first = by_document[r.document][0] is r
        burst = by_document[r.document][:size] if first else [r]
        number = groups[-1] + 1 if groups else 0
        for member in burst:
            taken.add(member.id)
            groups.append(number)
            ordered.append(replace(member, id=len(ordered)))
    return ordered, groups


def poisson_arrivals(
    n: int, rate: float, seed: int = 0, groups: Sequence[int] | None = None
) -> list[float]:
    """Arrival times in seconds from the start, in order: a Poisson process of ``rate``
    requests/s, seeded (``rate`` 0: all at once).

    With ``groups`` (a non-decreasing group number per request) the requests
    of one group arrive together and the gap before a group of ``k`` is drawn
    with mean ``k / rate``, so the offered load stays ``rate`` requests/s.
    """
    if rate < 0:
        raise ValueError(f"rate must be >= 0 requests/s, not {rate}")
    members = list(groups) if groups is not None else list(range(n))
    if len(members) != n or any(b < a for a, b in itertools.pairwise(members)):
        raise ValueError("groups must be one non-decreasing group number per request")
    if rate == 0 or n == 0:
        return [0.0] * n
    sizes = np.unique(members, return_counts=True)[1]
    gaps = np.random.default_rng(seed).exponential(1.0, len(sizes)) * sizes / rate
    return np.repeat(np.cumsum(gaps), sizes).tolist()
