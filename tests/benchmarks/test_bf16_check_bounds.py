"""bf16_check's top-1 bound: a shortfall against HF bf16 that chance gives two equally good
roundings passes, one a wrong fast path gives fails (the figures are the bound's own cases)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bf16_check import Closeness  # noqa: E402


def closeness(positions: int, disagreements: int, ours_right: int, hf_right: int, mean_gap: float = 0.03) -> Closeness:
    return Closeness(
        positions=positions,
        top1_agreement=(positions - disagreements) / positions,
        top1_vs_fp32=ours_right / positions,
        hf_bf16_top1_vs_fp32=hf_right / positions,
        mean_gap=mean_gap,
        hf_bf16_vs_fp32=0.022,
        bound=0.044,
    )


def test_two_short_on_four_disagreements_is_chance():
    """The Zen 3 case: 150 against HF's 152 of 157, where the two part at four positions."""
    assert closeness(157, 4, 150, 152).passed


def test_a_path_that_loses_most_of_many_disagreements_fails():
    assert not closeness(157, 40, 118, 150).passed  # 32 short on 40 disagreements: 3 sqrt(40) allows 19
    assert not closeness(400, 30, 360, 385).passed  # 25 short on 30: 3 sqrt(30) allows 16.4


def test_the_allowance_is_never_under_one_position_in_a_hundred():
    assert closeness(1000, 9, 950, 959).top1_shortfall_allowed == 0.01  # 3 sqrt(9) = 9 positions: 0.9%
    assert closeness(157, 4, 150, 152).top1_shortfall_allowed == 6 / 157


def test_the_logprob_gap_still_binds():
    assert not closeness(157, 0, 152, 152, mean_gap=0.05).passed
