"""Length-prefixed pickled messages over TCP: the per-step path between the engine and its Ray
worker actors.

Ray places, starts, watches and kills the workers; the steps themselves go over one socket per
worker, because an actor call costs about a millisecond and a socket round trip a few tens of
microseconds. Both ends block in `recv` while idle, so nothing busy-polls.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!Q")


class ChannelClosed(ConnectionError):
    """The peer closed the connection or its process died."""


def send_message(sock: socket.socket, message: Any) -> None:
    send_bytes(sock, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def send_bytes(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_message(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return pickle.loads(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        try:
            count = sock.recv_into(view[received:])
        except OSError as error:  # reset by a killed peer
            raise ChannelClosed(str(error)) from error
        if count == 0:
            raise ChannelClosed("connection closed by peer")
        received += count
    return buffer


def listen(host: str) -> socket.socket:
    server = socket.create_server((host, 0), backlog=64)
    return server


def connect(host: str, port: int, timeout: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
