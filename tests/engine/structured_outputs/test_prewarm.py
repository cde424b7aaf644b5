"""A server's engine builds its grammar backend at start (structured_outputs_prewarm), in the
compile pool, so the first constrained request does not wait for the tokenizer and the
vocabulary tables; an offline engine still builds it on first use."""

from __future__ import annotations

import logging

import pytest

from pagedserve import LLM
from pagedserve.cluster.server_config import ServerConfig
from pagedserve.engine.structured_outputs.manager import StructuredOutputManager
from pagedserve.sampling_params import StructuredOutputsParams
from tests.cluster.conftest import wait_until
from tests.engine.structured_outputs.conftest import PERSON_SCHEMA

VOCAB = 544


class CountingLoader:
    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self):
        self.calls += 1
        return self.tokenizer


@pytest.mark.parametrize("setting, built", [("auto", "xgrammar"), ("guidance", "guidance")])
def test_prewarm_builds_the_backend_the_setting_picks(tokenizer, setting, built):
    loader = CountingLoader(tokenizer)
    manager = StructuredOutputManager(loader, VOCAB, [tokenizer.eos_token_id], backend=setting)
    try:
        assert loader.calls == 0  # nothing is read until asked
        manager.prewarm().result(timeout=60)
        assert list(manager._backends) == [built] and loader.calls == 1
        grammar = manager.grammar_for(StructuredOutputsParams(json=PERSON_SCHEMA))
        grammar.future.result(timeout=60)
        assert loader.calls == 1 and list(manager._backends) == [built]  # the request used the prebuilt one
    finally:
        manager.shutdown()


def test_a_failed_prewarm_is_logged_and_the_request_says_why(tokenizer, caplog):
    def broken():
        raise OSError("no tokenizer in this folder")

    manager = StructuredOutputManager(broken, VOCAB, [tokenizer.eos_token_id])
    try:
        with caplog.at_level(logging.WARNING):
            manager.prewarm().result(timeout=60)  # no exception: nothing waits on it
        assert "no tokenizer in this folder" in caplog.text
        grammar = manager.grammar_for(StructuredOutputsParams(json=PERSON_SCHEMA))
        with pytest.raises(OSError, match="no tokenizer in this folder"):
            grammar.future.result(timeout=60)
    finally:
        manager.shutdown()


def test_the_server_turns_it_on_and_its_engine_builds_the_backend_at_start(model_dirs):
    config = ServerConfig(model=str(model_dirs["llama"]))
    assert config.engine_config().structured_outputs_prewarm is True
    assert ServerConfig(model="m", engine={"structured_outputs_prewarm": False}).engine_config().structured_outputs_prewarm is False
    llm = LLM(str(model_dirs["llama"]), max_model_len=128, structured_outputs_prewarm=True)
    try:
        manager = llm.llm_engine.engine_core.engine_core.structured_outputs
        wait_until(lambda: "xgrammar" in manager._backends, timeout=60, what="the backend built at start")  # no request sent
    finally:
        llm.shutdown()
    offline = LLM(str(model_dirs["llama"]), max_model_len=128)
    try:
        assert not offline.llm_engine.engine_core.engine_core.structured_outputs._backends
    finally:
        offline.shutdown()
