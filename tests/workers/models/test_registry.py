"""workers/models/registry.py: config.json's architecture name -> the model class."""

from __future__ import annotations

import pytest

from pagedserve.workers.models.llama import LlamaForCausalLM
from pagedserve.workers.models.registry import model_class


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_llama_family_architectures_share_one_class(architecture):
    assert model_class(architecture) is LlamaForCausalLM


def test_an_unknown_architecture_names_itself_and_the_supported_ones():
    with pytest.raises(ValueError) as raised:
        model_class("GPT2LMHeadModel")
    assert str(raised.value) == (
        "unsupported architecture 'GPT2LMHeadModel'; supported: "
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    )
