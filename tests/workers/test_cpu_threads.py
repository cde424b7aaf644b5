"""`num_cpu_threads`: the torch threads a CPU engine's process runs the model with."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM


def test_num_cpu_threads_sets_the_engine_process_threads(model_dirs):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(model_dirs["llama"]), max_model_len=64, dtype="float32", num_cpu_threads=1)
        assert torch.get_num_threads() == 1
        llm.shutdown()
    finally:
        torch.set_num_threads(before)


def test_num_cpu_threads_below_one_is_refused(model_dirs):
    with pytest.raises(ValueError, match="num_cpu_threads"):
        LLM(str(model_dirs["llama"]), num_cpu_threads=0)
