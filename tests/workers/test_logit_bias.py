"""OpenAI's logit_bias: validated in SamplingParams, refused past the vocabulary by the engine's
input check, and added to the logits of its own row only (greedy, random, logprobs unbiased)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from tests.workers.test_sampler import CPU, EOS, sample, state


def test_bias_moves_greedy_pick_of_its_row_only():
    logits = torch.tensor([[3.0, 1.0, 0.0, 0.0]] * 3)
    states = [state(SamplingParams(temperature=0.0, logit_bias={2: 5.0})),
              state(SamplingParams(temperature=0.0)),
              state(SamplingParams(temperature=0.0, logit_bias={0: -100}))]
    assert sample(logits, states).sampled_token_ids.tolist() == [2, 0, 1]


def test_random_row_never_picks_a_token_biased_down_by_100():
    logits = torch.zeros(2000, 3)
    tokens = sample(logits, [state(SamplingParams(logit_bias={1: -100.0}))] * 2000).sampled_token_ids
    assert 1 not in tokens.tolist() and {0, 2} <= set(tokens.tolist())


def test_logprobs_stay_the_models():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    out = sample(logits, [state(SamplingParams(temperature=0.0, logprobs=1, logit_bias={2: 10}))])
    assert out.sampled_token_ids.tolist() == [2]
    assert out.logprobs[0, 0].item() == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())


@pytest.mark.parametrize("bias, fragment", [({1: 101}, "between -100 and 100"), ({-1: 1.0}, "non-negative"),
                                            ({True: 1.0}, "non-negative"), ([1], "a dict"), ({1: "x"}, "between")])
def test_bad_bias_is_refused(bias, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(logit_bias=bias)


def test_engine_refuses_ids_past_the_vocabulary(model_dirs):
    from pagedserve import LLM

    llm = LLM(str(model_dirs["llama"]), max_model_len=64)
    try:
        with pytest.raises(ValueError, match="logit_bias token ids"):
            llm.generate("hi", SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}), use_tqdm=False)
    finally:
        llm.shutdown()
