"""cluster/prompt_renderer.py: the ingress's prompts turned into token ids with the engine's own
tokenizer (a real tiny checkpoint's), chat through its template; token ids pass untouched; a
tokenizer that cannot load leaves prompts as given and is tried again with the next request."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.cluster.prompt_renderer import PromptRenderer
from pagedserve.engine.chat import render_chat

MESSAGES = [{"role": "user", "content": "Hello there"}]


class Spec:
    """LLMServer.prompt_spec() as the ingress asks it: counts the calls, can fail."""

    def __init__(self, spec: dict):
        self.spec, self.num_calls = spec, 0

    async def __call__(self) -> dict:
        self.num_calls += 1
        return self.spec


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return str(next(iter(model_dirs.values())))


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=60))


def test_text_and_chat_become_token_ids_of_the_engines_tokenizer(model_dir, tokenizer):
    renderer = PromptRenderer(Spec({"model": model_dir, "max_model_len": 2048}))

    async def render_both():
        return await renderer.render("Hello there"), await renderer.render({"messages": MESSAGES, "add_generation_prompt": True})

    text, chat = run(render_both())
    assert text["prompt_token_ids"] == tokenizer.encode("Hello there") and text.get("prompt") == "Hello there"
    expected = render_chat(tokenizer, MESSAGES)
    assert chat["prompt_token_ids"] == expected["prompt_token_ids"] and chat.get("prompt") == expected["prompt"]


def test_token_ids_pass_untouched_and_the_tokenizer_loads_once(model_dir):
    spec = Spec({"model": model_dir, "max_model_len": 2048})
    renderer = PromptRenderer(spec)
    ids = {"prompt_token_ids": [3, 1, 4]}

    async def twice():
        return [await renderer.render(ids), await renderer.render(ids)]

    assert run(twice()) == [ids, ids]
    assert spec.num_calls == 1


def test_a_chat_the_template_rejects_is_a_value_error(model_dir):
    renderer = PromptRenderer(Spec({"model": model_dir, "max_model_len": 2048}))
    bad = {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True}

    async def render_with_broken_template():
        thread = await renderer._tokenizer()  # the TokenizerThread the renderer encodes on
        thread.tokenizer.chat_template = "{{ raise_exception('no') }}"
        return await renderer.render(bad)

    with pytest.raises(ValueError, match="cannot apply the chat template"):
        run(render_with_broken_template())


def test_without_a_tokenizer_prompts_go_as_given_and_the_next_request_tries_again(tmp_path):
    spec = Spec({"model": str(tmp_path / "no-such-model")})
    renderer = PromptRenderer(spec)

    async def two_requests():
        first = await renderer.render("Hello")
        second = await renderer.render({"messages": MESSAGES, "add_generation_prompt": True})
        return first, second

    first, second = run(two_requests())
    assert first == "Hello" and second == {"messages": MESSAGES, "add_generation_prompt": True}
    assert spec.num_calls == 2  # a failed load is not kept: each request tries again


def test_start_begins_loading_only_on_an_event_loop(model_dir):
    spec = Spec({"model": model_dir, "max_model_len": 2048})
    renderer = PromptRenderer(spec)
    renderer.start()  # no loop running here: nothing starts
    assert renderer._loading is None and spec.num_calls == 0

    async def started_then_rendered():
        renderer.start()
        assert renderer._loading is not None
        await asyncio.sleep(0)
        return await renderer.render("Hi")

    assert run(started_then_rendered())["prompt_token_ids"]
    assert spec.num_calls == 1
