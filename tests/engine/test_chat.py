"""engine/chat.py: a conversation through the tokenizer's chat template into the engine's prompt
(text and ids, with no second set of special tokens), with the real test tokenizer and its
ChatML template, and a template's refusal as a ValueError."""

from __future__ import annotations

import pytest

from pagedserve.engine.chat import render_chat

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_the_prompt_is_the_templates_text_and_its_ids(tokenizer):
    prompt = render_chat(tokenizer, MESSAGES)
    expected_text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt["prompt"] == expected_text
    assert "Be brief." in prompt["prompt"] and "Hi" in prompt["prompt"]
    # The template holds the special tokens already: none are added in front of them.
    assert prompt["prompt_token_ids"] == tokenizer.encode(expected_text, add_special_tokens=False)
    assert tokenizer.decode(prompt["prompt_token_ids"]) == expected_text


def test_add_generation_prompt_opens_the_assistants_turn(tokenizer):
    with_turn = render_chat(tokenizer, MESSAGES, add_generation_prompt=True)["prompt"]
    without = render_chat(tokenizer, MESSAGES, add_generation_prompt=False)["prompt"]
    assert with_turn != without and with_turn.startswith(without)


def test_a_template_given_overrides_the_tokenizers(tokenizer):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    prompt = render_chat(tokenizer, MESSAGES, chat_template=template)
    assert prompt["prompt"] == "[system] Be brief.\n[user] Hi\n"


def test_a_template_that_raises_is_a_value_error_saying_so(tokenizer):
    template = "{{ raise_exception('only user messages') }}"
    with pytest.raises(ValueError, match=r"^cannot apply the chat template: .*only user messages"):
        render_chat(tokenizer, MESSAGES, chat_template=template)
