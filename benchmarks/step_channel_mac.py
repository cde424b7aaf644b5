"""What the step channel's per-frame MAC and sequence check cost: a typical step, sent and received
over a local socket pair with the authenticated framing, against the same bytes with a bare length
header (the framing before MACs), in one run.

Steps measured (pickled `SchedulerOutput`s as the scheduler makes them):
- `decode_64`: 64 running requests, one new token each (the common step).
- `prefill_4x2048`: 4 new requests of 2048 prompt tokens with their sampling parameters.

Figures are medians over `--steps` one-way transfers (send, receive, unpickle) in microseconds;
`mac_us` is the difference, `mac_compute_us` the MAC computations alone (the sender's and the
receiver's: SHA-256 of the payload, then HMAC-SHA256 over the header and that digest).

    python benchmarks/step_channel_mac.py
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import pickle
import socket
import statistics
import struct
import threading
import time

from pagedserve.step_types.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.workers import step_channel


def decode_step(num_requests: int) -> SchedulerOutput:
    cached = CachedRequestData()
    for index in range(num_requests):
        cached.req_ids.append(f"cmpl-{index:032x}-0")
        cached.new_token_ids.append([1234])
        cached.new_block_ids.append([])
        cached.num_computed_tokens.append(700 + index)
    tokens = {req_id: 1 for req_id in cached.req_ids}
    return SchedulerOutput([], cached, tokens, len(tokens), set())


def prefill_step(num_requests: int, num_tokens: int) -> SchedulerOutput:
    new = [
        NewRequestData(f"cmpl-{index:032x}-0", list(range(1000, 1000 + num_tokens)), num_tokens,
                       SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256), list(range(num_tokens // 16)), 0)
        for index in range(num_requests)
    ]  # fmt: skip
    return SchedulerOutput(new, CachedRequestData(), {r.req_id: num_tokens for r in new}, num_requests * num_tokens, set())


def channel_pair() -> tuple[step_channel.Channel, step_channel.Channel]:
    engine, worker = socket.socketpair()
    secret, worker_side = step_channel.new_secret(), []
    thread = threading.Thread(target=lambda: worker_side.append(step_channel.authenticate_engine(worker, secret, 0)))
    thread.start()
    _, engine_side = step_channel.authenticate_worker(engine, secret, 1)
    thread.join()
    return engine_side, worker_side[0]


def bare_transfer(sender: socket.socket, receiver: socket.socket, payload: bytes) -> None:
    sender.sendall(struct.pack("!Q", len(payload)) + payload)
    (size,) = struct.unpack("!Q", step_channel._recv_exactly(receiver, 8))
    pickle.loads(step_channel._recv_exactly(receiver, size))


def authenticated_transfer(sender: step_channel.Channel, receiver: step_channel.Channel, payload: bytes) -> None:
    step_channel.send_bytes(sender, payload)
    step_channel.recv_message(receiver)


def median_us(transfer, steps: int) -> float:
    samples = []
    for _ in range(steps):
        started = time.perf_counter()
        transfer()
        samples.append(time.perf_counter() - started)
    return round(statistics.median(samples) * 1e6, 2)


def measure(step: SchedulerOutput, steps: int) -> dict:
    payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
    engine, worker = channel_pair()
    bare_left, bare_right = socket.socketpair()
    key = step_channel.new_secret()
    bare = median_us(lambda: bare_transfer(bare_left, bare_right, payload), steps)
    macd = median_us(lambda: authenticated_transfer(engine, worker, payload), steps)
    header = bytes(16)
    hmac_only = median_us(lambda: [hmac.new(key, header + hashlib.sha256(payload).digest(), hashlib.sha256).digest() for _ in range(2)], steps)
    for sock in (engine, worker, bare_left, bare_right):
        sock.close()
    return {"payload_bytes": len(payload), "bare_us": bare, "authenticated_us": macd,
            "mac_us": round(macd - bare, 2), "mac_compute_us": hmac_only}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    steps = parser.parse_args().steps
    results = {"decode_64": measure(decode_step(64), steps), "prefill_4x2048": measure(prefill_step(4, 2048), steps)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
