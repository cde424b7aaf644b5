"""The replica side of a drain: an LLMServer replica whose process is sent SIGTERM hands its
streams over to other replicas and then exits, instead of dying with them. (A SIGTERM to its
node's raylet, as `ray stop` sends, takes the replica down at once: a crash, not covered.)

What Ray 2.60 does with SIGTERM in a worker process (ray/_private/worker.py and
workers/default_worker.py, checked on a live Serve replica):
- default_worker.py ends in `Worker.main_loop()` on the process's main thread, which installs a
  SIGTERM handler that raises SystemExit through `raise_sys_exit_with_custom_error_message("The
  process receives a SIGTERM.", exit_code=1)` and then blocks in the core worker's task loop (C++).
- Python runs signal handlers on the main thread only, and only there may `signal.signal` be
  called. A Serve replica's code never runs there: Serve's ReplicaActor runs on an asyncio thread,
  the deployment's `__init__` and methods on Serve's user-code event-loop thread (`signal.signal`
  raises ValueError there). The main thread runs Python only when the core worker checks for
  signals (PyErr_CheckSignals from its task loop): a `Py_AddPendingCall` never runs.
- The SystemExit makes the core worker exit: it starts no new actor task (calls routed to it
  wait), waits for the tasks it runs however long they take (a long stream runs on to its end),
  and for the tasks it submitted (a replica always has some: Serve's long polls to the
  controller, which last 30 to 60 s), then exits as a SYSTEM_ERROR; Serve's controller sees a
  crashed actor and starts a replacement, and the calls that waited are retried elsewhere.
  Whoever sent SIGTERM may send SIGKILL first (Kubernetes after the pod's grace period, `ray stop`
  after its own): then the streams end in errors.

So the only code that runs on the main thread at a SIGTERM is Ray's handler, and it looks its
exit function up in its module's globals when it runs. `SigtermHook.install` (ray_internals.py) puts a function
there that hands the SIGTERM to the replica's `ReplicaDrain` instead of raising. If the handler
installed is not the one described above (another Ray; not a Ray worker) nothing is installed
and SIGTERM stays Ray's. Once drained, the replica ends its actor as Serve ends a stopped replica,
with `ray.kill` (`end_actor`): at once, where Ray's own exit would wait on the long polls, and
with a death cause the ingress reads as a stop, not a crash.

The drain (`ReplicaDrain`, on the replica's event loop):
1. New `generate` calls are refused with a `Handover` item: the ingress marks the replica leaving
   and sends the request elsewhere (cluster/handover.py), never showing the client an error. The
   replica's routing stats say `is_draining`, so routers stop picking it; the refusal covers the
   time until they hear.
2. Every stream that can move (streamed as deltas, of any `n`, or nothing sent yet) ends at once
   with a `Handover` item: the ingress resumes it on another replica from what the client has.
   Others (cumulative outputs with text sent; the ingress never asks for those) run on, until
   `drain_timeout_s`; then they end the same way.
3. With no stream left, the engine shuts down and the actor ends (`end_actor`), within
   EXIT_DEADLINE_S whatever hangs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any, AsyncIterator, Awaitable, Callable

from pagedserve.cluster.stream_race import RIVAL_FIRST, next_unless
from pagedserve.engine.request_output import RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("ray.serve")  # into the replica's log, beside Serve's own news

# Once drained, nothing is left to save: the engine gets ENGINE_STOP_S to release its workers
# (a core process still running then is killed), and the whole exit, `ray.kill` included, is
# bounded by EXIT_DEADLINE_S. (A CI run saw a drained replica still alive 9.4 s on; a drained
# exit here takes about 0.2 s.)
ENGINE_STOP_S = 2.0
EXIT_DEADLINE_S = 6.0


def exit_by_deadline() -> None:
    """Should this process still run EXIT_DEADLINE_S from now (a shutdown that hangs, a GCS out
    of reach), it ends itself."""
    timer = threading.Timer(EXIT_DEADLINE_S, _exit_late)
    timer.daemon = True
    timer.start()


def _exit_late() -> None:
    logger.warning("the drained replica still ran %g s after its drain ended: exiting", EXIT_DEADLINE_S)
    os._exit(1)


def end_actor() -> None:
    """End this process's actor as Serve's controller ends a stopped replica (`ray.kill`)."""
    import ray

    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def can_resume(params: SamplingParams) -> bool:
    """A stream the ingress can resume after it has sent text (stream_progress.py's StreamProgress.can_move):
    deltas, of one choice or of several (each choice resumes as its own request)."""
    return params.output_kind == RequestOutputKind.DELTA


class ReplicaDrain:
    """The drain of one replica (see the module's note). Create it on the replica's event loop;
    `start` runs there, `on_sigterm` may be called from any thread."""

    def __init__(self, handover: Any, timeout_s: float, on_drained: Callable[[], Awaitable[None]]):
        """`handover`: the item a moved stream ends with; `on_drained`: awaited once no stream
        is left (it stops the engine and exits)."""
        self.handover = handover
        self.timeout_s = timeout_s
        self.on_drained = on_drained
        self.is_draining = False
        self.num_streams = 0
        self._loop = asyncio.get_running_loop()
        self._moving = asyncio.Event()  # set at the start: streams that can move end now
        self._stopping = asyncio.Event()  # set at the deadline: every stream ends now
        self._idle = asyncio.Event()
        self._idle.set()
        self._finishing: asyncio.Task | None = None

    def on_sigterm(self) -> bool:
        try:
            self._loop.call_soon_threadsafe(self.start)
        except RuntimeError:  # the replica's loop is closed: nothing to drain
            return False
        return True

    def start(self) -> None:
        if self.is_draining:
            return  # a second SIGTERM: the drain goes on
        self.is_draining = True
        logger.warning("SIGTERM: draining; handing %d streams over, exiting within %g s", self.num_streams, self.timeout_s)
        self._moving.set()
        self._loop.call_later(self.timeout_s, self._stopping.set)
        self._finishing = self._loop.create_task(self._finish())

    async def _finish(self) -> None:
        await self._idle.wait()
        logger.warning("drained: no stream left; exiting")
        await self.on_drained()

    async def stream(self, outputs: AsyncIterator[RequestOutput], params: SamplingParams) -> AsyncIterator[Any]:
        """`outputs`, until they end or the drain moves the stream: then its last item is the
        Handover (and `outputs` is closed, which aborts the engine request)."""
        self.num_streams += 1
        self._idle.clear()
        moving = asyncio.ensure_future(self._moving.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        num_sent = 0
        try:
            while True:
                stop = moving if num_sent == 0 or can_resume(params) else stopping
                item = await next_unless(outputs, stop)
                if item is RIVAL_FIRST:
                    yield self.handover
                    return
                if item is None:
                    return
                num_sent += 1
                yield item
        finally:
            moving.cancel()
            stopping.cancel()
            self.num_streams -= 1
            if self.num_streams == 0:
                self._idle.set()
