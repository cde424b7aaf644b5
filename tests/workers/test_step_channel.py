"""The step channel on its own: framing, the size cap, a peer that goes away, the handshake and
the accept loop (a silent or lying peer never takes a rank nor holds up the real ones)."""

from __future__ import annotations

import pickle
import socket
import threading
import tracemalloc

import pytest

from pagedserve.step_types.model_runner_output import ModelRunnerOutput
from pagedserve.workers import step_channel
from pagedserve.workers.step_channel import ChannelClosed, ChannelError, StepReply


@pytest.fixture
def pair():
    left, right = socket.socketpair()
    left.settimeout(30)
    right.settimeout(30)
    yield left, right
    left.close()
    right.close()


def test_round_trip(pair):
    left, right = pair
    reply = StepReply(output=ModelRunnerOutput(["a", "b"], [7, 9]))
    step_channel.send_message(left, reply)
    step_channel.send_message(left, StepReply(error="rank 1: boom"))
    first, second = step_channel.recv_message(right), step_channel.recv_message(right)
    assert first == reply and not first.is_error
    assert second.is_error and second.error == "rank 1: boom"


def test_oversized_header_is_rejected_before_allocating(pair):
    left, right = pair
    left.sendall((2**62).to_bytes(8, "big"))
    tracemalloc.start()
    try:
        with pytest.raises(ChannelError, match="limit"):
            step_channel.recv_message(right)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024**2


def test_message_at_the_limit_plus_one_is_refused_on_send(pair, monkeypatch):
    monkeypatch.setattr(step_channel, "MAX_MESSAGE_BYTES", 100)
    with pytest.raises(ChannelError, match="exceeds"):
        step_channel.send_bytes(pair[0], b"x" * 101)


def test_peer_closing_mid_message(pair):
    left, right = pair
    payload = pickle.dumps(list(range(1000)))
    left.sendall(len(payload).to_bytes(8, "big") + payload[:100])
    left.close()
    with pytest.raises(ChannelClosed):
        step_channel.recv_message(right)


def test_peer_closing_between_messages(pair):
    left, right = pair
    left.close()
    with pytest.raises(ChannelClosed):
        step_channel.recv_message(right)


def test_handshake_both_ways(pair):
    engine, worker = pair
    secret = step_channel.new_secret()
    worker_side = threading.Thread(target=step_channel.authenticate_engine, args=(worker, secret, 3))
    worker_side.start()
    assert step_channel.authenticate_worker(engine, secret, world_size=4) == 3
    worker_side.join()


def test_bad_hmac_is_rejected(pair):
    engine, worker = pair
    errors = []

    def wrong_worker():
        try:
            step_channel.authenticate_engine(worker, step_channel.new_secret(), 0)
        except OSError as error:
            errors.append(error)

    thread = threading.Thread(target=wrong_worker)
    thread.start()
    with pytest.raises(ChannelError, match="wrong HMAC"):
        step_channel.authenticate_worker(engine, step_channel.new_secret(), world_size=1)
    engine.close()
    thread.join()
    assert errors  # the worker never got our proof: it stops too


def test_worker_rejects_an_engine_without_the_secret(pair):
    """The worker's side checks the engine: a listener that only echoes garbage gets nothing."""
    impostor, worker = pair
    secret = step_channel.new_secret()

    def impostor_engine():
        impostor.sendall(b"n" * step_channel.NONCE_BYTES)
        impostor.recv(4096)
        impostor.sendall(b"m" * 32)

    thread = threading.Thread(target=impostor_engine)
    thread.start()
    with pytest.raises(ChannelError, match="not our engine"):
        step_channel.authenticate_engine(worker, secret, 0)
    thread.join()


def test_rank_out_of_range_is_rejected(pair):
    engine, worker = pair
    secret = step_channel.new_secret()
    thread = threading.Thread(target=step_channel.authenticate_engine, args=(worker, secret, 5))
    thread.start()
    with pytest.raises(ChannelError, match="rank 5"):
        step_channel.authenticate_worker(engine, secret, world_size=2)
    thread.join()


def _worker(port: int, secret: bytes, rank: int) -> socket.socket:
    sock = step_channel.connect("127.0.0.1", port, timeout=30)
    step_channel.authenticate_engine(sock, secret, rank)
    return sock


def test_accept_ranks_skips_rogues_and_duplicates(monkeypatch, caplog):
    """A silent peer (holding its connection open), a peer with a wrong secret, a pickle sender
    and a second claim of a taken rank: none gets a rank, the real ranks still get in, nothing
    the rogues sent is unpickled, and the log names neither the secret nor the payload."""
    monkeypatch.setattr(step_channel, "HANDSHAKE_TIMEOUT_S", 60.0)  # the silent peer outlives the test
    secret = step_channel.new_secret()
    unpickled = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: unpickled.append(a))
    with step_channel.listen("127.0.0.1") as server:
        port = server.getsockname()[1]
        silent = socket.create_connection(("127.0.0.1", port))
        liar = socket.create_connection(("127.0.0.1", port))
        liar.sendall(b"\x80\x04" + b"z" * 200)
        workers, outcomes = [], []

        def connect_all():
            try:
                _worker(port, step_channel.new_secret(), 0)
            except OSError:
                outcomes.append("wrong secret refused")
            workers.append(_worker(port, secret, 1))
            duplicate = _worker(port, secret, 1)
            duplicate.settimeout(30)
            if duplicate.recv(1) == b"":  # the engine closed it
                outcomes.append("duplicate rank refused")
            workers.append(_worker(port, secret, 0))

        thread = threading.Thread(target=connect_all)
        thread.start()
        with caplog.at_level("WARNING", logger=step_channel.__name__):
            conns = step_channel.accept_ranks(server, secret, 2, timeout_s=60, on_idle=lambda: None)
        thread.join()
    assert len(conns) == 2
    assert outcomes == ["wrong secret refused", "duplicate rank refused"]
    # Each authenticated socket is the one its rank opened.
    for rank, worker in ((0, workers[1]), (1, workers[0])):
        worker.sendall(f"rank {rank}".encode())
        assert conns[rank].recv(16) == f"rank {rank}".encode()
    assert not unpickled
    assert "wrong HMAC" in caplog.text and "rank 1" in caplog.text
    assert secret.hex() not in caplog.text and "zzzz" not in caplog.text
    for sock in [silent, liar, *conns, *workers]:
        sock.close()


def test_accept_ranks_times_out_and_reports(monkeypatch):
    with step_channel.listen("127.0.0.1") as server:
        with pytest.raises(ChannelError, match="did not connect"):
            step_channel.accept_ranks(server, step_channel.new_secret(), 1, timeout_s=0.5, on_idle=lambda: None)
