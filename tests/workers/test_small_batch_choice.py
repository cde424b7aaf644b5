"""Which few-row bf16 products take the native small-batch kernel is chosen at start-up by timing
both paths on the model's layers (small_batch_choice.py): the choice follows the timings, with
the kernel kept near a tie, `linear` then routes each row count to the chosen path, the choice is
logged, and PAGEDSERVE_SMALL_LINEAR_ROWS overrides it."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.workers.layers import cpu_gemm, small_batch_choice

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cpu_forward import build  # noqa: E402  (the model as a CPU worker loads it)

needs_kernel = pytest.mark.skipif(cpu_gemm.small_batch_rows() == 0, reason="no AVX-512 BF16 (or no compiler) here: nothing to choose")


@pytest.fixture(autouse=True)
def restore_choice(monkeypatch):
    """The choice is process-wide: each test leaves it as it found it."""
    before = list(cpu_gemm._kernel_rows)
    monkeypatch.delenv(small_batch_choice.ENV_OVERRIDE, raising=False)
    yield
    cpu_gemm._kernel_rows[:] = before


def timings(kernel_ms: list[float], onednn_ms: list[float]) -> small_batch_choice.Timings:
    out = {}
    for rows, (k, o) in enumerate(zip(kernel_ms, onednn_ms), start=1):
        out[(rows, "kernel")], out[(rows, "onednn")] = k / 1e3, o / 1e3
    return out


def test_the_kernel_keeps_the_rows_where_it_is_faster_or_near_a_tie():
    measured = timings([8.0, 8.0, 10.4, 11.0], [12.0, 7.0, 10.0, 10.0])  # wins, loses by 14%, ties (+4%), loses by 10%
    assert small_batch_choice.kernel_wins(measured, 4) == {1, 3}
    assert small_batch_choice.kernel_wins(measured, 4, margin=1.0) == {1}
    assert small_batch_choice.kernel_wins(timings([9.0] * 4, [8.0] * 4), 4) == frozenset()


@needs_kernel
@torch.inference_mode()
def test_linear_takes_the_chosen_path_at_each_row_count():
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 64, generator=generator) * 0.05).to(torch.bfloat16)
    packed = cpu_gemm.pack(weight)
    cpu_gemm.set_kernel_rows(frozenset({1, 3}))
    assert cpu_gemm.kernel_rows() == {1, 3}
    for rows in (1, 2, 3, 4, 5):
        x = torch.randn(rows, 64, generator=generator).to(torch.bfloat16)
        expected = cpu_gemm.small_linear(x, weight, None) if rows in (1, 3) else cpu_gemm.onednn_linear(x, packed, None)
        assert torch.equal(cpu_gemm.linear(x, packed, None, weight), expected), rows


@needs_kernel
def test_a_cpu_engine_times_the_models_layers_at_start_up_and_logs_the_choice(model_dirs, caplog):
    from pagedserve import LLM

    with caplog.at_level(logging.INFO, logger=small_batch_choice.__name__):
        llm = LLM(str(model_dirs["llama"]), dtype="bfloat16", max_model_len=128, num_cpu_threads=1)
    llm.shutdown()
    assert "small-batch bf16 kernel at rows" in caplog.text and "1 threads: kernel against oneDNN 1 rows" in caplog.text
    assert cpu_gemm.kernel_rows() <= set(range(1, cpu_gemm.small_batch_rows() + 1))


@needs_kernel
def test_the_timing_restores_the_thread_count(model_dirs):
    model = build(model_dirs["llama"], torch.bfloat16, max_positions=128)
    before = torch.get_num_threads()
    small_batch_choice.time_paths(small_batch_choice.streamed_layers(model), 2, num_threads=1 if before != 1 else 2, repeats=1)
    assert torch.get_num_threads() == before


@needs_kernel  # elsewhere no layer keeps its plain weight: nothing to stream
def test_a_budget_stops_the_layers_streamed(model_dirs):
    model = build(model_dirs["llama"], torch.bfloat16, max_positions=128)
    every = small_batch_choice.streamed_layers(model, budget_bytes=2**40)
    first = every[0].weight.nbytes
    assert small_batch_choice.streamed_layers(model, budget_bytes=first) == every[:1]
    assert len(small_batch_choice.streamed_layers(model, budget_bytes=first + every[1].weight.nbytes)) == 2


@needs_kernel
def test_the_override_skips_the_timing(monkeypatch, caplog):
    monkeypatch.setenv(small_batch_choice.ENV_OVERRIDE, "2")
    monkeypatch.setattr(small_batch_choice, "time_paths", lambda *args, **kwargs: pytest.fail("timed despite the override"))
    with caplog.at_level(logging.INFO, logger=small_batch_choice.__name__):
        assert small_batch_choice.choose_kernel_rows(torch.nn.Linear(2, 2), num_threads=1) == {1, 2}
    assert f"{small_batch_choice.ENV_OVERRIDE}=2" in caplog.text
    monkeypatch.setenv(small_batch_choice.ENV_OVERRIDE, "0")
    assert small_batch_choice.choose_kernel_rows(torch.nn.Linear(2, 2), num_threads=1) == frozenset()


@pytest.mark.parametrize("bad", ["-1", "four", ""])
def test_a_bad_override_says_what_is_allowed(monkeypatch, bad):
    monkeypatch.setenv(small_batch_choice.ENV_OVERRIDE, bad)
    with pytest.raises(ValueError, match=f"{small_batch_choice.ENV_OVERRIDE}=.*expected a row count, 0 \\(never the kernel\\)"):
        small_batch_choice.choose_kernel_rows(torch.nn.Linear(2, 2), num_threads=1)
