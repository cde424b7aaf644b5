"""The core process's client: what it does when a message cannot be sent. The sender thread
carries every message to the core; a message it cannot send must fail alone (its request ends),
never the thread, or every later request would wait forever."""

from __future__ import annotations

import pickle
import threading

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.core import messages
from pagedserve.engine.core.messages import AddRequest

CORE = {"engine_core_process": True, "num_cpu_threads": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def add_request_size(llm: LLM, prompt: str, params: SamplingParams) -> int:
    processed = llm.llm_engine.input_processor.process(prompt, params)
    return len(pickle.dumps(AddRequest("r", processed, params, 0.0), protocol=pickle.HIGHEST_PROTOCOL))


def generate_within(llm: LLM, prompts: list[str], params: list[SamplingParams], timeout: float = 120) -> list:
    """llm.generate, failing the test (not hanging it) if the requests never come back: a dead
    sender thread leaves them waiting forever (the finally's shutdown then ends the call)."""
    results: list = []
    thread = threading.Thread(target=lambda: results.append(llm.generate(prompts, params, use_tqdm=False)), daemon=True)
    thread.start()
    thread.join(timeout)
    assert results, f"the requests did not come back within {timeout:.0f} s"
    return results[0]


def test_an_unsendable_request_fails_alone_and_the_sender_goes_on(model_dirs, monkeypatch):
    llm = LLM(str(model_dirs["llama"]), max_model_len=128, dtype="float32", **CORE)
    try:
        big = GREEDY.clone(stop=["x" * 200 + str(i) for i in range(12)])  # a few KiB of stop strings
        small_size, big_size = add_request_size(llm, "Hello", GREEDY), add_request_size(llm, "Hello", big)
        assert big_size > small_size + 2000
        # The front end's limit now lies between the two: the big request cannot be sent.
        monkeypatch.setattr(messages, "MAX_MESSAGE_BYTES", small_size + 1000)
        outputs = generate_within(llm, ["Hello", "Hello", "Hello"], [GREEDY, big, GREEDY])
        assert [o.outputs[0].finish_reason for o in outputs] == ["length", "abort", "length"]
        # Later requests still reach the core.
        again = generate_within(llm, ["Hello"], [GREEDY])
        assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_oversized_messages_are_refused_on_both_ends():
    """64 MiB is the channel's limit: the sender refuses a larger message before writing it, and
    the receiver refuses a larger frame before allocating it."""
    import socket
    from multiprocessing.connection import Connection

    assert messages.MAX_MESSAGE_BYTES == 64 * 1024**2
    left, right = socket.socketpair()
    sender, receiver = Connection(left.detach()), Connection(right.detach())
    try:
        with pytest.raises(ValueError, match="exceeds the 67108864-byte limit"):
            messages.send(sender, b"x" * (messages.MAX_MESSAGE_BYTES + 1))
        messages.send(sender, {"fits": True})
        assert messages.recv(receiver) == {"fits": True}
        sender.send_bytes(b"x" * 64)  # a frame over a (lowered) limit, written around send()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(messages, "MAX_MESSAGE_BYTES", 32)
            with pytest.raises(OSError):
                messages.recv(receiver)
    finally:
        sender.close()
        receiver.close()
