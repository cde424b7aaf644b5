"""The step channel on its own: framing, the size cap, a peer that goes away, the handshake and
the accept loop (a silent or lying peer never takes a rank nor holds up the real ones)."""

from __future__ import annotations

import pickle
import socket
import threading
import time
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


@pytest.fixture
def channels(pair):
    """An engine-side and a worker-side channel, authenticated by the real handshake."""
    engine, worker = pair
    secret = step_channel.new_secret()
    worker_side: list[step_channel.Channel] = []
    thread = threading.Thread(target=lambda: worker_side.append(step_channel.authenticate_engine(worker, secret, 0)))
    thread.start()
    _, engine_channel = step_channel.authenticate_worker(engine, secret, world_size=1)
    thread.join()
    return engine_channel, worker_side[0]


@pytest.fixture
def unpickled(monkeypatch):
    """Everything the channel hands to pickle.loads (nothing is unpickled while it is patched)."""
    seen: list = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: seen.append(a))
    return seen


def test_round_trip(channels):
    engine, worker = channels
    reply = StepReply(output=ModelRunnerOutput(["a", "b"], [7, 9]))
    step_channel.send_message(worker, reply)
    step_channel.send_message(worker, StepReply(error="rank 1: boom"))
    first, second = step_channel.recv_message(engine), step_channel.recv_message(engine)
    assert first == reply and not first.is_error
    assert second.is_error and second.error == "rank 1: boom"
    step_channel.send_message(engine, "step 0")  # the other direction keeps its own sequence
    assert step_channel.recv_message(worker) == "step 0"
    payload = pickle.dumps("step 1")  # one payload for every rank: its digest is computed once
    step_channel.send_bytes(engine, payload, step_channel.payload_digest(payload))
    assert step_channel.recv_message(worker) == "step 1"


def test_oversized_header_is_rejected_before_allocating(channels, pair):
    engine, _ = channels
    pair[1].sendall((2**62).to_bytes(8, "big") + bytes(8 + 32))
    tracemalloc.start()
    try:
        with pytest.raises(ChannelError, match="limit"):
            step_channel.recv_message(engine)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024**2


def test_message_at_the_limit_plus_one_is_refused_on_send(channels, monkeypatch):
    monkeypatch.setattr(step_channel, "MAX_MESSAGE_BYTES", 100)
    with pytest.raises(ChannelError, match="exceeds"):
        step_channel.send_bytes(channels[0], b"x" * 101)


def test_peer_closing_mid_message(channels, pair):
    engine, _ = channels
    payload = pickle.dumps(list(range(1000)))
    pair[1].sendall(len(payload).to_bytes(8, "big") + bytes(8 + 32) + payload[:100])
    pair[1].close()
    with pytest.raises(ChannelClosed):
        step_channel.recv_message(engine)


def test_peer_closing_between_messages(channels, pair):
    pair[1].close()
    with pytest.raises(ChannelClosed):
        step_channel.recv_message(channels[0])


def _frame_of(sender: step_channel.Channel, wire: socket.socket, message) -> bytes:
    step_channel.send_message(sender, message)
    size = int.from_bytes(wire.recv(8, socket.MSG_PEEK), "big")
    return _read(wire, 8 + 8 + 32 + size)


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        data += sock.recv(size - len(data))
    return data


@pytest.mark.parametrize("tamper", ["payload", "sequence", "mac"])
def test_tampered_frame_closes_the_channel_unread(channels, pair, unpickled, tamper):
    """A frame altered on the wire (or forged by someone who injects into the connection) fails
    its MAC: the receiver closes the connection and unpickles nothing."""
    engine, worker = channels
    frame = bytearray(_frame_of(worker, pair[0], StepReply(error="honest")))
    offset = {"payload": len(frame) - 3, "sequence": 15, "mac": 20}[tamper]
    frame[offset] ^= 0x01
    pair[1].sendall(bytes(frame))
    with pytest.raises(ChannelError, match="MAC|out of order"):
        step_channel.recv_message(engine)
    assert not unpickled
    assert engine.fileno() == -1  # closed


def test_replayed_frame_closes_the_channel_unread(channels, pair, monkeypatch):
    engine, worker = channels
    frame = _frame_of(worker, pair[0], "step reply")
    pair[1].sendall(frame)
    assert step_channel.recv_message(engine) == "step reply"
    seen = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: seen.append(a))
    pair[1].sendall(frame)  # the same frame again: a valid MAC, an old sequence number
    with pytest.raises(ChannelError, match="out of order or replayed \\(sequence 0, expected 1\\)"):
        step_channel.recv_message(engine)
    assert not seen and engine.fileno() == -1


def test_reflected_frame_fails_its_mac(channels, pair, unpickled):
    """The engine's own frame sent back to it: same key and sequence, other direction."""
    engine, _ = channels
    frame = _frame_of(engine, pair[1], "step")
    pair[1].sendall(frame)
    with pytest.raises(ChannelError, match="MAC"):
        step_channel.recv_message(engine)
    assert not unpickled


def test_a_frame_from_another_session_fails_its_mac(unpickled):
    """A frame recorded from one group's channel (same secret, other nonces) is refused by another."""
    secret = step_channel.new_secret()
    sessions = []
    for _ in range(2):
        engine, worker = socket.socketpair()
        worker_side = []
        thread = threading.Thread(target=lambda: worker_side.append(step_channel.authenticate_engine(worker, secret, 0)))
        thread.start()
        engine_side = step_channel.authenticate_worker(engine, secret, 1)[1]
        thread.join()
        sessions.append((engine_side, worker_side[0]))
    (first_engine, first_worker), (second_engine, second_worker) = sessions
    frame = _frame_of(first_worker, first_engine.sock, "recorded")
    second_worker.sock.sendall(frame)
    with pytest.raises(ChannelError, match="MAC"):
        step_channel.recv_message(second_engine)
    assert not unpickled
    for pair_of_channels in sessions:
        for channel in pair_of_channels:
            channel.close()


def test_handshake_both_ways(pair):
    engine, worker = pair
    secret = step_channel.new_secret()
    worker_side = threading.Thread(target=step_channel.authenticate_engine, args=(worker, secret, 3))
    worker_side.start()
    assert step_channel.authenticate_worker(engine, secret, world_size=4)[0] == 3
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


def _worker(port: int, secret: bytes, rank: int, source_ip: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source_ip, 0))
    step_channel.authenticate_engine(sock, secret, rank)
    return sock


def _closed_without_a_word(sock: socket.socket) -> bool:
    """The listener closed `sock` without sending anything (a reset if it left our bytes unread)."""
    try:
        return sock.recv(64) == b""
    except ConnectionResetError:
        return True


def _accept_in_background(server, secret: bytes, world_size: int, timeout_s: float, **kwargs):
    """accept_ranks on a thread; returns the thread and a list that gets its result or error."""
    outcome: list = []

    def run():
        try:
            outcome.append(step_channel.accept_ranks(server, secret, world_size, timeout_s, lambda: None, **kwargs))
        except Exception as error:
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


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
        assert conns[rank].sock.recv(16) == f"rank {rank}".encode()
    assert not unpickled
    assert "wrong HMAC" in caplog.text and "rank 1" in caplog.text
    assert secret.hex() not in caplog.text and "zzzz" not in caplog.text
    for sock in [silent, liar, *conns, *workers]:
        sock.close()


def test_accept_ranks_times_out_and_reports(monkeypatch):
    with step_channel.listen("127.0.0.1") as server:
        with pytest.raises(ChannelError, match="did not connect"):
            step_channel.accept_ranks(server, step_channel.new_secret(), 1, timeout_s=0.5, on_idle=lambda: None)


def test_peer_from_outside_the_group_is_refused_before_the_handshake(caplog, unpickled):
    """Only the group's node addresses may connect: a peer from another address (127.0.0.1 here;
    the group's node is 127.0.0.2, both loopback on Linux) gets no challenge, even with the secret."""
    secret = step_channel.new_secret()
    with step_channel.listen("127.0.0.1") as server, caplog.at_level("WARNING", logger=step_channel.__name__):
        port = server.getsockname()[1]
        thread, outcome = _accept_in_background(server, secret, 1, 60, allowed_ips={"127.0.0.2"})
        outsider = socket.create_connection(("127.0.0.1", port), timeout=30)
        outsider.sendall(pickle.dumps("unsolicited"))
        assert _closed_without_a_word(outsider)
        with pytest.raises(OSError):
            _worker(port, secret, 0, source_ip="127.0.0.1")  # the secret is not enough
        member = _worker(port, secret, 0, source_ip="127.0.0.2")
        thread.join()
    [channel] = outcome[0]
    assert "not a node of this worker group" in caplog.text
    assert not unpickled
    for sock in (outsider, member, channel):
        sock.close()


def test_handshakes_in_flight_are_capped(monkeypatch, caplog, unpickled):
    """Peers that connect and stay silent hold at most MAX_CONCURRENT_HANDSHAKES handshakes;
    more are closed at once, and the real rank gets in once the silent ones time out."""
    monkeypatch.setattr(step_channel, "MAX_CONCURRENT_HANDSHAKES", 2)
    monkeypatch.setattr(step_channel, "HANDSHAKE_TIMEOUT_S", 4.0)  # outlasts the six connects on a loaded machine
    secret = step_channel.new_secret()
    with step_channel.listen("127.0.0.1") as server, caplog.at_level("WARNING", logger=step_channel.__name__):
        port = server.getsockname()[1]
        thread, outcome = _accept_in_background(server, secret, 1, 60)
        silent = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(6)]
        answers = [sock.recv(step_channel.NONCE_BYTES) for sock in silent]  # a nonce, or closed
        assert sum(len(answer) == step_channel.NONCE_BYTES for answer in answers) == 2
        assert answers.count(b"") == 4
        time.sleep(step_channel.HANDSHAKE_TIMEOUT_S + 0.5)  # the two silent handshakes expire
        member = _worker(port, secret, 0)
        thread.join()
    assert len(outcome[0]) == 1
    assert caplog.text.count("handshakes already in flight") == 4
    assert not unpickled
    for sock in (*silent, member, *outcome[0]):
        sock.close()


def test_handshake_has_one_overall_deadline(monkeypatch):
    """A peer that trickles one byte at a time, each well inside a per-read timeout, is still
    dropped once the handshake's whole time is up."""
    monkeypatch.setattr(step_channel, "HANDSHAKE_TIMEOUT_S", 1.0)
    engine, trickler = socket.socketpair()
    stop = threading.Event()

    def trickle():
        trickler.recv(step_channel.NONCE_BYTES)
        while not stop.wait(0.2):
            try:
                trickler.sendall(b"x")
            except OSError:
                return

    thread = threading.Thread(target=trickle)
    thread.start()
    started = time.monotonic()
    with pytest.raises(ChannelError, match="sent nothing"):
        step_channel.authenticate_worker(engine, step_channel.new_secret(), world_size=1)
    assert time.monotonic() - started < 2.0  # 64 bytes at 5 a second would take 13 s
    stop.set()
    thread.join()
    engine.close()
    trickler.close()
