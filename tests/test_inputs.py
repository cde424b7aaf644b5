"""Prompts as typed dicts (pagedserve/inputs.py): built and told apart without string keys at the
call site, and still the plain dicts callers write and Serve pickles."""

from __future__ import annotations

import pickle

import pytest

import pagedserve
from pagedserve.inputs import ChatPrompt, TextPrompt, TokensPrompt, is_chat_prompt, is_tokens_prompt, tokens_prompt


def test_a_tokens_prompt_carries_its_text_only_when_known():
    assert tokens_prompt([1, 2]) == {"prompt_token_ids": [1, 2]}
    assert tokens_prompt([1, 2], "ab") == {"prompt_token_ids": [1, 2], "prompt": "ab"}
    assert pickle.loads(pickle.dumps(tokens_prompt([3], "c"))) == {"prompt_token_ids": [3], "prompt": "c"}


@pytest.mark.parametrize(
    "prompt, is_tokens, is_chat",
    [
        ("text", False, False),
        (TextPrompt(prompt="text"), False, False),
        (TokensPrompt(prompt_token_ids=[1]), True, False),
        ({"prompt_token_ids": "not checked here: the engine refuses it"}, True, False),
        (ChatPrompt(messages=[{"role": "user", "content": "hi"}]), False, True),
        ([1, 2], False, False),
    ],
)
def test_prompts_are_told_apart(prompt, is_tokens, is_chat):
    assert is_tokens_prompt(prompt) == is_tokens and is_chat_prompt(prompt) == is_chat


def test_the_prompt_types_are_exported_as_vllm_exports_them():
    assert pagedserve.TokensPrompt is TokensPrompt and pagedserve.TextPrompt is TextPrompt
