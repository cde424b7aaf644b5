"""The per-step path between the engine and its Ray worker actors: authenticated, length-prefixed
pickled messages over TCP, and the step reply they carry back.

Ray places, starts, watches and kills the workers; the steps themselves go over one socket per
worker, because an actor call costs about a millisecond and a socket round trip a few tens of
microseconds. Both ends block in `recv` while idle, so nothing busy-polls.

Pickle runs code, so nothing is unpickled before the peer has proved it holds the group's secret
(handed to each worker through the Ray actor call that starts its loop). The listener takes
connections only from the group's own node addresses, runs at most a bounded number of handshakes
at once, and gives each one overall deadline. The handshake, fixed-size fields only:

    engine -> worker   nonce_e                                 (NONCE_BYTES)
    worker -> engine   HMAC(secret, "worker" + nonce_e) + nonce_w
    engine -> worker   HMAC(secret, "engine" + nonce_w)        (the worker knows its engine too)
    worker -> engine   rank                                    (4-byte unsigned, big-endian)

Each side's MAC is over a nonce the other side chose, so a recorded handshake cannot be replayed.
After it, both sides hold a session key, HMAC(secret, "session" + nonce_e + nonce_w), and every
frame is

    length (8 bytes) | sequence number (8 bytes) | HMAC(key, direction + length + seq + SHA256(payload)) | payload

(The MAC covers the payload's SHA-256, so a step sent to every rank is hashed once, not per rank.)

The MAC and the sequence number (0, 1, 2, ... per direction) are checked before the payload is
unpickled, so a frame injected into an authenticated connection, altered, replayed, reordered or
reflected back to its sender closes the connection instead of running.
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
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from pagedserve.step_types.model_runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("!QQ")  # payload length, sequence number
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
# A real worker answers the challenge at once; a handshake not done in this long is dropped. Each
# handshake runs on its own thread, so a slow peer delays nobody else.
HANDSHAKE_TIMEOUT_S = 10.0
# Handshakes running at once (at least the group's size): bounds the threads that peers who
# connect and stay silent can hold; more are closed at once.
MAX_CONCURRENT_HANDSHAKES = 16


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


class Channel:
    """One authenticated connection (made by the handshake): frames carry a sequence number and
    a MAC under the session key, both checked before anything is unpickled. A frame that fails
    either check closes the connection. `fileno()` lets a selector watch it."""

    def __init__(self, sock: socket.socket, key: bytes, is_engine: bool):
        self.sock = sock
        # Each direction MACs its own label, so a frame reflected back to its sender fails. The
        # keyed states are made once and copied per frame (saves the key schedule each time).
        labels = (b"engine>worker", b"worker>engine") if is_engine else (b"worker>engine", b"engine>worker")
        self._send_mac, self._recv_mac = (hmac.new(key, label, hashlib.sha256) for label in labels)
        self._send_seq = 0
        self._recv_seq = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def close(self) -> None:
        self.sock.close()

    def send_bytes(self, payload: bytes, digest: bytes | None = None) -> None:
        """`digest`: payload_digest(payload), when the caller sends one payload to many."""
        if len(payload) > MAX_MESSAGE_BYTES:
            raise ChannelError(f"message of {len(payload)} bytes exceeds the channel's {MAX_MESSAGE_BYTES}-byte limit")
        header = _FRAME.pack(len(payload), self._send_seq)
        self._send_seq += 1
        self.sock.sendall(header + _frame_mac(self._send_mac, header, digest or payload_digest(payload)) + payload)

    def recv_bytes(self) -> bytearray:
        """The next frame's payload. Raises ChannelClosed if the peer went away, ChannelError
        (and closes the connection) on an oversized header, a wrong sequence number or MAC."""
        header = bytes(_recv_exactly(self.sock, _FRAME.size + _MAC_BYTES))
        size, sequence = _FRAME.unpack(header[: _FRAME.size])
        if size > MAX_MESSAGE_BYTES:
            self._refuse(f"peer announced a {size}-byte message; the limit is {MAX_MESSAGE_BYTES}")
        if sequence != self._recv_seq:
            self._refuse(f"frame out of order or replayed (sequence {sequence}, expected {self._recv_seq})")
        payload = _recv_exactly(self.sock, size)
        if not hmac.compare_digest(header[_FRAME.size :], _frame_mac(self._recv_mac, header[: _FRAME.size], payload_digest(payload))):
            self._refuse(f"frame {sequence} failed its MAC check (tampered or forged)")
        self._recv_seq += 1
        return payload

    def _refuse(self, reason: str) -> None:
        self.sock.close()
        raise ChannelError(f"step channel closed: {reason}")


def payload_digest(payload: bytes | bytearray) -> bytes:
    return hashlib.sha256(payload).digest()


def _frame_mac(keyed, header: bytes, digest: bytes) -> bytes:
    mac = keyed.copy()
    mac.update(header + digest)
    return mac.digest()


def send_message(channel: Channel, message: Any) -> None:
    channel.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def send_bytes(channel: Channel, payload: bytes, digest: bytes | None = None) -> None:
    channel.send_bytes(payload, digest)


def recv_message(channel: Channel) -> Any:
    """The next message from an authenticated peer, unpickled only once its MAC and sequence
    number check out. Raises ChannelClosed if the peer went away, ChannelError if it broke the
    protocol (an oversized header is refused before anything is allocated)."""
    return pickle.loads(channel.recv_bytes())


def _recv_exactly(sock: socket.socket, size: int, deadline: float | None = None) -> bytearray:
    """`size` bytes; with a `deadline` (time.monotonic()), all of them by then, however the
    peer spaces them out (a per-recv timeout alone lets a trickle hold the socket for ever)."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            count = sock.recv_into(view[received:])
        except socket.timeout as error:  # a subclass of OSError: not a death but a silent peer
            raise ChannelError(f"peer sent nothing for {sock.gettimeout():.3g} s") from error
        except OSError as error:  # reset by a killed peer
            raise ChannelClosed(str(error)) from error
        if count == 0:
            raise ChannelClosed("connection closed by peer")
        received += count
    return buffer


# ---- the handshake ------------------------------------------------------------------------


def _mac(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def _session_key(secret: bytes, engine_nonce: bytes, worker_nonce: bytes) -> bytes:
    return hmac.new(secret, b"session" + engine_nonce + worker_nonce, hashlib.sha256).digest()


def authenticate_worker(sock: socket.socket, secret: bytes, world_size: int) -> tuple[int, Channel]:
    """Engine side, on a freshly accepted socket: prove the peer holds the secret, prove ours,
    and return the rank it claims (0 <= rank < world_size) with the authenticated channel. The
    whole handshake must finish within HANDSHAKE_TIMEOUT_S. Raises ChannelError or
    ChannelClosed; nothing the peer sends is unpickled here."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(nonce)
    answer = bytes(_recv_exactly(sock, _MAC_BYTES + NONCE_BYTES, deadline))
    if not hmac.compare_digest(answer[:_MAC_BYTES], _mac(secret, b"worker", nonce)):
        raise ChannelError("peer failed the handshake (wrong HMAC)")
    worker_nonce = answer[_MAC_BYTES:]
    sock.sendall(_mac(secret, b"engine", worker_nonce))
    (rank,) = _RANK.unpack(_recv_exactly(sock, _RANK.size, deadline))
    if rank >= world_size:
        raise ChannelError(f"authenticated peer claims rank {rank}; the group has ranks 0..{world_size - 1}")
    return rank, Channel(sock, _session_key(secret, nonce, worker_nonce), is_engine=True)


def authenticate_engine(sock: socket.socket, secret: bytes, rank: int) -> Channel:
    """Worker side, right after connecting: answer the engine's challenge, check its answer to
    ours, then send our rank. Raises ChannelError if the other end does not hold the secret."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    challenge = bytes(_recv_exactly(sock, NONCE_BYTES, deadline))
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(_mac(secret, b"worker", challenge) + nonce)
    answer = bytes(_recv_exactly(sock, _MAC_BYTES, deadline))
    if not hmac.compare_digest(answer, _mac(secret, b"engine", nonce)):
        raise ChannelError("the step channel's listener failed the handshake (wrong HMAC): not our engine")
    sock.sendall(_RANK.pack(rank))
    return Channel(sock, _session_key(secret, challenge, nonce), is_engine=False)


def accept_ranks(
    server: socket.socket,
    secret: bytes,
    world_size: int,
    timeout_s: float,
    on_idle: Callable[[], None],
    allowed_ips: Collection[str] | None = None,
) -> list[Channel]:
    """Accept connections on `server` until each rank 0..world_size-1 has one authenticated
    channel; returns them by rank. A peer from outside `allowed_ips` (the group's node addresses;
    None admits any), one past the cap on concurrent handshakes, one that fails the handshake or
    claims a rank already taken, is closed and logged (its address and the reason; never the
    secret or what it sent). `on_idle` runs about once a second while waiting (the executor
    checks its workers are alive there). Raises ChannelError if the ranks are not all in after
    `timeout_s`."""
    results: queue.Queue[tuple[int, Channel]] = queue.Queue()
    wake_reader, wake_writer = socket.socketpair()
    gate = _HandshakeGate(secret, world_size, allowed_ips, results, wake_writer)
    by_rank: dict[int, Channel] = {}
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
                        gate.admit(*server.accept())
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


class _HandshakeGate:
    """Admits accepted connections to a handshake (each on its own thread, so a slow peer
    delays nobody else): only from allowed addresses, and at most `limit` at once, so peers
    that connect and stay silent cannot pile up threads."""

    def __init__(self, secret: bytes, world_size: int, allowed_ips, results: queue.Queue, wake: socket.socket):
        self.secret, self.world_size, self.results, self.wake = secret, world_size, results, wake
        self.allowed_ips = None if allowed_ips is None else frozenset(allowed_ips)
        self.limit = max(MAX_CONCURRENT_HANDSHAKES, world_size)  # the real ranks always fit
        self.in_flight = 0
        self.lock = threading.Lock()

    def admit(self, conn: socket.socket, address: tuple) -> None:
        if self.allowed_ips is not None and address[0] not in self.allowed_ips:
            logger.warning("step channel: closed a connection from %s: not a node of this worker group", address)
            conn.close()
            return
        with self.lock:
            if self.in_flight >= self.limit:
                logger.warning("step channel: closed a connection from %s: %d handshakes already in flight", address, self.limit)
                conn.close()
                return
            self.in_flight += 1
        threading.Thread(target=self._handshake, args=(conn, address), name="step-channel-handshake", daemon=True).start()

    def _handshake(self, conn: socket.socket, address: tuple) -> None:
        try:
            rank, channel = authenticate_worker(conn, self.secret, self.world_size)
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.results.put((rank, channel))
        except (OSError, ChannelError) as error:  # ChannelClosed and timeouts are OSErrors
            logger.warning("step channel: closed a connection from %s that failed the handshake: %s", address, error)
            conn.close()
        finally:
            with self.lock:
                self.in_flight -= 1
        try:
            self.wake.send(b"\0")
        except OSError:  # the accept loop is over
            pass


def _take_authenticated(results: queue.Queue, by_rank: dict[int, Channel]) -> None:
    while not results.empty():
        rank, channel = results.get_nowait()
        if rank in by_rank:
            logger.warning("step channel: closed a second connection claiming rank %d", rank)
            channel.close()
        else:
            by_rank[rank] = channel


# ---- sockets --------------------------------------------------------------------------------


def listen(host: str) -> socket.socket:
    return socket.create_server((host, 0), backlog=64)


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """Connect with `timeout` for the connection and the handshake (the caller clears it after)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
