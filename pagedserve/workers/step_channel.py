"""The per-step path between the engine and its Ray worker actors: authenticated, length-prefixed
pickled messages over TCP, and the step reply they carry back.

Ray places, starts, watches and kills the workers; the steps themselves go over one socket per
worker, because an actor call costs about a millisecond and a socket round trip a few tens of
microseconds. Both ends block in `recv` while idle, so nothing busy-polls.

Pickle runs code, so nothing is unpickled before the peer has proved it holds the group's secret
(handed to each worker through the Ray actor call that starts its loop). The handshake, fixed-size
fields only:

    engine -> worker   nonce_e                                 (NONCE_BYTES)
    worker -> engine   HMAC(secret, "worker" + nonce_e) + nonce_w
    engine -> worker   HMAC(secret, "engine" + nonce_w)        (the worker knows its engine too)
    worker -> engine   rank                                    (4-byte unsigned, big-endian)

Each side's MAC is over a nonce the other side chose, so a recorded handshake cannot be replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import pickle
import queue
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.step_types.model_runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")
_RANK = struct.Struct("!I")
NONCE_BYTES = 32
SECRET_BYTES = 32
_MAC_BYTES = hashlib.sha256().digest_size
# The largest message either side accepts, checked before anything is allocated. A step carries a
# new request's whole token list (prompt + outputs so far); a pickled token id takes 3 to 5 bytes,
# so 256 new requests (max_num_seqs' default) of 128k tokens each come to about 170 MB. 512 MiB
# leaves room for that with sampling parameters and block tables, and still stops a corrupt or
# hostile 8-byte header from claiming the host's memory.
MAX_MESSAGE_BYTES = 512 * 1024**2
# A real worker answers the challenge at once; a peer silent for this long is dropped. Each
# handshake runs on its own thread, so a slow peer delays nobody else.
HANDSHAKE_TIMEOUT_S = 10.0


class ChannelClosed(ConnectionError):
    """The peer closed the connection or its process died."""


class ChannelError(ConnectionError):
    """The peer broke the protocol: a failed handshake, an oversized message, a silent peer."""


@dataclass
class StepReply:
    """A worker's answer to one step."""

    # The sampled tokens from the sampling rank; None from the other ranks (and on error).
    output: ModelRunnerOutput | None = None
    # The worker's traceback when the step raised; the engine then rebuilds the group.
    error: str | None = None

    @property
    def is_error(self) -> bool:
        return self.error is not None


def new_secret() -> bytes:
    """A worker group's secret: made per group, never logged, sent only through Ray actor calls."""
    return secrets.token_bytes(SECRET_BYTES)


# ---- framing ------------------------------------------------------------------------------


def send_message(sock: socket.socket, message: Any) -> None:
    send_bytes(sock, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def send_bytes(sock: socket.socket, payload: bytes) -> None:
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ChannelError(f"message of {len(payload)} bytes exceeds the channel's {MAX_MESSAGE_BYTES}-byte limit")
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_message(sock: socket.socket) -> Any:
    """The next message from an authenticated peer. Raises ChannelClosed if the peer went away,
    ChannelError if its header claims more than MAX_MESSAGE_BYTES (nothing is allocated then)."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if size > MAX_MESSAGE_BYTES:
        raise ChannelError(f"peer announced a {size}-byte message; the limit is {MAX_MESSAGE_BYTES}")
    return pickle.loads(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        try:
            count = sock.recv_into(view[received:])
        except socket.timeout as error:  # a subclass of OSError: not a death but a silent peer
            raise ChannelError(f"peer sent nothing for {sock.gettimeout()} s") from error
        except OSError as error:  # reset by a killed peer
            raise ChannelClosed(str(error)) from error
        if count == 0:
            raise ChannelClosed("connection closed by peer")
        received += count
    return buffer


# ---- the handshake ------------------------------------------------------------------------


def _mac(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def authenticate_worker(sock: socket.socket, secret: bytes, world_size: int) -> int:
    """Engine side, on a freshly accepted socket (with a timeout set): prove the peer holds the
    secret, prove ours, and return the rank it claims (0 <= rank < world_size). Raises
    ChannelError or ChannelClosed; nothing the peer sends is unpickled here."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(nonce)
    answer = bytes(_recv_exactly(sock, _MAC_BYTES + NONCE_BYTES))
    if not hmac.compare_digest(answer[:_MAC_BYTES], _mac(secret, b"worker", nonce)):
        raise ChannelError("peer failed the handshake (wrong HMAC)")
    sock.sendall(_mac(secret, b"engine", answer[_MAC_BYTES:]))
    (rank,) = _RANK.unpack(_recv_exactly(sock, _RANK.size))
    if rank >= world_size:
        raise ChannelError(f"authenticated peer claims rank {rank}; the group has ranks 0..{world_size - 1}")
    return rank


def authenticate_engine(sock: socket.socket, secret: bytes, rank: int) -> None:
    """Worker side, right after connecting: answer the engine's challenge, check its answer to
    ours, then send our rank. Raises ChannelError if the other end does not hold the secret."""
    challenge = bytes(_recv_exactly(sock, NONCE_BYTES))
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(_mac(secret, b"worker", challenge) + nonce)
    answer = bytes(_recv_exactly(sock, _MAC_BYTES))
    if not hmac.compare_digest(answer, _mac(secret, b"engine", nonce)):
        raise ChannelError("the step channel's listener failed the handshake (wrong HMAC): not our engine")
    sock.sendall(_RANK.pack(rank))


def accept_ranks(
    server: socket.socket, secret: bytes, world_size: int, timeout_s: float, on_idle: Callable[[], None]
) -> list[socket.socket]:
    """Accept connections on `server` until each rank 0..world_size-1 has one authenticated
    socket; returns them by rank. A peer that fails the handshake, or claims a rank already taken,
    is closed and logged (its address and the reason; never the secret or what it sent).
    `on_idle` runs about once a second while waiting (the executor checks its workers are alive
    there). Raises ChannelError if the ranks are not all in after `timeout_s`."""
    results: queue.Queue[tuple[int, socket.socket]] = queue.Queue()
    wake_reader, wake_writer = socket.socketpair()
    by_rank: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(server, selectors.EVENT_READ)
            selector.register(wake_reader, selectors.EVENT_READ)
            while len(by_rank) < world_size:
                if time.monotonic() > deadline:
                    raise ChannelError(f"workers did not connect to the step channel within {timeout_s:.0f} s")
                events = selector.select(timeout=1.0)
                if not events:
                    on_idle()
                for key, _ in events:
                    if key.fileobj is server:
                        _start_handshake(server, secret, world_size, results, wake_writer)
                    else:
                        wake_reader.recv(4096)
                _take_authenticated(results, by_rank)
    except BaseException:
        for conn in by_rank.values():
            conn.close()
        raise
    finally:
        wake_reader.close()
        wake_writer.close()
    return [by_rank[rank] for rank in range(world_size)]


def _start_handshake(server, secret: bytes, world_size: int, results: queue.Queue, wake: socket.socket) -> None:
    conn, address = server.accept()

    def handshake() -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            rank = authenticate_worker(conn, secret, world_size)
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            results.put((rank, conn))
        except (OSError, ChannelError) as error:  # ChannelClosed and timeouts are OSErrors
            logger.warning("step channel: closed a connection from %s that failed the handshake: %s", address, error)
            conn.close()
        try:
            wake.send(b"\0")
        except OSError:  # the accept loop is over
            pass

    threading.Thread(target=handshake, name="step-channel-handshake", daemon=True).start()


def _take_authenticated(results: queue.Queue, by_rank: dict[int, socket.socket]) -> None:
    while not results.empty():
        rank, conn = results.get_nowait()
        if rank in by_rank:
            logger.warning("step channel: closed a second connection claiming rank %d", rank)
            conn.close()
        else:
            by_rank[rank] = conn


# ---- sockets --------------------------------------------------------------------------------


def listen(host: str) -> socket.socket:
    return socket.create_server((host, 0), backlog=64)


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """Connect with `timeout` for the connection and the handshake (the caller clears it after)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
