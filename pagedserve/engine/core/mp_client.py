"""MPClient: the engine core in its own process (proc.py); this client starts it and talks to it.

Sends go through a queue and a sender thread, so a caller (an asyncio event loop) never waits
for the core to read, however long its step; order is kept. Receives block the caller's thread
(the front end's output thread) until the core's next step ends.
"""

from __future__ import annotations

import logging
import queue
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from pagedserve.config import EngineConfig, WorkerPlacement
from pagedserve.engine.core import messages
from pagedserve.engine.core.client import EngineCoreClient
from pagedserve.engine.core.messages import AddRequest, CoreFailed, CoreOutputs, CoreReady, RefuseRequest, ShutdownCore, StartCore
from pagedserve.engine.core.step_clock import StepClock

logger = logging.getLogger(__name__)

STARTUP_POLL_S = 0.5
STARTUP_TIMEOUT_S = 3600.0  # loading a large checkpoint takes minutes; a dead child is seen at once


class MPClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, placement: WorkerPlacement | None = None):
        """Starts the core and waits until it is built; its errors are raised here."""
        super().__init__()
        parent_end, child_end = socket.socketpair()
        self.clock = StepClock()
        command = [
            sys.executable, "-m", "pagedserve.engine.core.proc",
            "--conn-fd", str(child_end.fileno()), "--clock-fd", str(self.clock.fd),
        ]
        # Its own session: a Ctrl-C at the terminal reaches the server, which shuts the core down
        # in order (graceful shutdown lets in-flight requests finish first).
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(child_end.fileno(), self.clock.fd), start_new_session=True)
        child_end.close()
        self.conn = Connection(parent_end.detach())
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="pagedserve-core-sender", daemon=True)
        self._sender.start()
        try:
            self._send(StartCore(config, placement, *_ray_cluster(config)))
            ready = self._wait_ready()
        except BaseException:
            self.shutdown(timeout=0)
            raise
        self.model_config = ready.model_config
        self.num_kv_blocks = ready.num_kv_blocks

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def step_started(self) -> float | None:
        return self.clock.started

    def _send(self, message: Any) -> None:
        """Queue a message for the sender thread (a core that has gone is reported by get_output)."""
        self._outbox.put(message)

    def _get_output(self) -> CoreOutputs:
        try:
            return messages.recv(self.conn)
        except OSError as error:  # the connection broke or was closed under us
            raise EOFError(str(error)) from None

    def exit_reason(self) -> str:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "the engine core process stopped answering"
        return f"the engine core process exited (code {code})"

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the core to release its workers and exit; kill it after `timeout`. Idempotent."""
        if self.conn.closed:
            return
        if self.process.poll() is None:
            self._outbox.put(ShutdownCore())
            self._outbox.put(None)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core did not exit within %.0f s: killing it", timeout)
                self.process.kill()
                self.process.wait()
        self._outbox.put(None)
        self.conn.close()
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.clock.close()

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._send_or_refuse(message)
            except OSError:  # the core is gone: get_output reports it
                return

    def _send_or_refuse(self, message: Any) -> None:
        """Send one message. One that cannot be sent (over the size limit, unpicklable) fails
        alone: an AddRequest's request ends with "abort" through the core (which then still
        answers), anything else is logged. The thread must go on: every later request needs it."""
        try:
            messages.send(self.conn, message)
        except OSError:
            raise
        except Exception as error:
            logger.exception("could not send a %s to the engine core", type(message).__name__)
            if isinstance(message, AddRequest):
                messages.send(self.conn, RefuseRequest(message.request_id, message.params.n, f"{type(error).__name__}: {error}"))

    def _wait_ready(self) -> CoreReady:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.conn.poll(STARTUP_POLL_S):
            if self.process.poll() is not None:
                raise RuntimeError(f"the engine core process exited (code {self.process.returncode}) while starting; see its log above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not start within {STARTUP_TIMEOUT_S:.0f} s")
        message = messages.recv(self.conn)
        if isinstance(message, CoreFailed):
            raise message.error
        return message


def _ray_cluster(config: EngineConfig) -> tuple[str | None, str | None]:
    """The Ray cluster this process is connected to, for a core whose executor uses Ray: it joins
    the same cluster and namespace (so a Serve replica's placement group is visible to it)."""
    if config.executor_backend != "ray":
        return None, None
    import ray

    if not ray.is_initialized():
        return None, None  # the core starts or joins Ray itself, as an in-process engine would
    context = ray.get_runtime_context()
    return context.gcs_address, context.namespace
