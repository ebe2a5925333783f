"""Schedulers route by load alone, or by prefix affinity; the trace is seeded and shared."""

from __future__ import annotations

import numpy as np
import pytest

from beluga.kv.hashing import prefix_hashes
from beluga.serving.scheduler import LocalityAware, LocalityFree, least_loaded, make_scheduler
from beluga.serving.trace import TraceShape, in_bursts, lv_eval_trace, poisson_arrivals

DOC_A = list(range(100))
DOC_B = list(range(200, 300))


def test_locality_free_follows_the_least_outstanding_work() -> None:
    s = LocalityFree(3)
    assert s.route(DOC_A, [50, 10, 30]) == 1
    assert s.route(DOC_A, [10, 5, 30]) == 1
    assert s.route(DOC_B, [7, 7, 30]) == 0  # a tie goes to the engine routed to least


def test_locality_free_spreads_a_burst_by_turns() -> None:
    s = LocalityFree(2)
    assert [s.route(DOC_A, [0, 0]) for _ in range(4)] == [0, 1, 0, 1]


def test_locality_aware_sends_a_known_prefix_home_whatever_the_load() -> None:
    s = LocalityAware(2, affinity_tokens=64)
    assert s.route([*DOC_A, 1], [0, 0]) == 0
    assert s.route([*DOC_B, 2], [100, 0]) == 1
    assert s.route([*DOC_A, 3, 4], [10_000, 0]) == 0  # same first 64 tokens
    assert s.route(DOC_B, [0, 10_000]) == 1
    assert s.route(list(range(50)), [10_000, 0]) == 1  # a new prefix goes to the least loaded


def test_schedulers_are_made_by_name() -> None:
    assert isinstance(make_scheduler("locality-free", 2), LocalityFree)
    assert make_scheduler("locality-aware", 2).name == "locality-aware"
    with pytest.raises(ValueError, match="choose from"):
        make_scheduler("round-robin", 2)
    with pytest.raises(ValueError, match="no engines"):
        least_loaded([], [])
    with pytest.raises(ValueError, match="affinity_tokens"):
        LocalityAware(2, affinity_tokens=0)


def test_the_trace_shares_each_document_among_its_questions() -> None:
    shape = TraceShape(documents=3, min_questions=2, max_questions=4, context_tokens=100)
    trace = lv_eval_trace(shape, vocab_size=1000, seed=7)
    assert trace == lv_eval_trace(shape, vocab_size=1000, seed=7)
    assert trace != lv_eval_trace(shape, vocab_size=1000, seed=8)
    assert [r.id for r in trace] == list(range(len(trace)))
    docs = {r.document for r in trace}
    assert docs == {0, 1, 2}
    for d in docs:
        mine = [r for r in trace if r.document == d]
        assert 2 <= len(mine) <= 4
        assert len({r.token_ids[:100] for r in mine}) == 1
        assert len({r.token_ids[100:] for r in mine}) == len(mine)
        assert all(16 <= len(r.token_ids) - 100 <= 48 for r in mine)
    assert len({r.token_ids[:100] for r in trace}) == 3
    assert [r.document for r in trace] != sorted(r.document for r in trace)  # shuffled
    assert all(0 <= t < 1000 for r in trace for t in r.token_ids)


def test_the_trace_stores_the_blocks_its_sizing_expects() -> None:
    from beluga.bench.e2e_figures import blocks_needed

    shape = TraceShape(documents=3, context_tokens=100, min_question_tokens=1)
    trace = lv_eval_trace(shape, vocab_size=50, seed=1)
    distinct = {k for r in trace for k in prefix_hashes(list(r.token_ids), 16)}
    assert blocks_needed(trace, shape, 16) >= len(distinct)
    assert blocks_needed(trace, shape, 16) - len(distinct) <= len(trace)  # rare repeats


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("documents", 0, "documents must be >= 1"),
        ("max_questions", 1, "max_questions"),
        ("max_question_tokens", 4, "max_question_tokens"),
    ],
)
def test_trace_shapes_are_checked(field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TraceShape(**{field: value})


def test_the_trace_needs_a_vocabulary() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        lv_eval_trace(TraceShape(), vocab_size=1)


def test_bursts_bring_each_documents_first_questions_together() -> None:
    shape = TraceShape(documents=3, min_questions=3, max_questions=5, context_tokens=32)
    trace = lv_eval_trace(shape, vocab_size=100, seed=4)
    bursty, groups = in_bursts(trace, 2)
    assert sorted(r.token_ids for r in bursty) == sorted(r.token_ids for r in trace)
    assert [r.id for r in bursty] == list(range(len(trace)))
    assert groups == sorted(groups) and groups[0] == 0
    members: dict[int, list[int]] = {}
    for r, g in zip(bursty, groups, strict=True):
        members.setdefault(g, []).append(r.document)
    firsts = [docs for docs in members.values() if len(docs) == 2]
    assert sorted(docs[0] for docs in firsts) == [0, 1, 2]  # one burst per document
    assert all(len(set(docs)) == 1 for docs in firsts)  # of that document's questions
    for doc in range(3):  # the document's first two questions, in their own order
        want = [r.token_ids for r in trace if r.document == doc][:2]
        got = [r.token_ids for r in bursty if r.document == doc][:2]
        assert got == want
    assert in_bursts(trace, 1) == (trace, list(range(len(trace))))
    with pytest.raises(ValueError, match="at least 1"):
        in_bursts(trace, 0)


def test_poisson_arrivals_keep_the_offered_rate_and_bursts_arrive_together() -> None:
    assert poisson_arrivals(5, 0.0) == [0.0] * 5
    times = poisson_arrivals(4000, 50.0, seed=3)
    assert times == poisson_arrivals(4000, 50.0, seed=3) != poisson_arrivals(4000, 50.0, seed=4)
    gaps = np.diff([0.0, *times])
    assert (gaps > 0).all() and abs(gaps.mean() - 1 / 50) < 0.1 / 50  # within 10% of 20 ms
    groups = [g // 4 for g in range(4000)]  # bursts of four
    bursts = poisson_arrivals(4000, 50.0, seed=3, groups=groups)
    assert all(len(set(bursts[i : i + 4])) == 1 for i in range(0, 4000, 4))
    assert abs(bursts[-1] / 4000 - 1 / 50) < 0.1 / 50  # the same load, four at a time
    with pytest.raises(ValueError, match="non-decreasing"):
        poisson_arrivals(3, 1.0, groups=[0, 2, 1])
    with pytest.raises(ValueError, match="rate must be >= 0"):
        poisson_arrivals(3, -1.0)
