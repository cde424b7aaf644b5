"""The engine core process (vLLM v1's EngineCoreProc): `python -m pagedserve.engine.core.proc
--conn-fd N --clock-fd M`, started by MPClient with one end of a socket pair and the step clock.
An EngineCore runs in a busy loop: take every waiting message, step, send the step's news,
repeat; block only when idle.

It dies with its parent: stdin is a pipe from the parent that nobody else holds, so its end of
file (the parent exited, however it died) ends this process, even in the middle of a step.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import pickle
import select
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported in main(), after the parent watcher starts
    from pagedserve.engine.core.engine_core import EngineCore
    from pagedserve.engine.core.step_clock import StepClock

PARENT_CHECK_INTERVAL_S = 1.0

logger = logging.getLogger("pagedserve.engine.core.proc")


def _exit_with_parent(parent_pid: int) -> None:
    """Ends the process at stdin's EOF, or if it was re-parented (belt and braces: a forked
    sibling could hold the pipe open)."""
    while True:
        readable, _, _ = select.select([sys.stdin.buffer], [], [], PARENT_CHECK_INTERVAL_S)
        if readable and not os.read(sys.stdin.fileno(), 4096):
            break
        if os.getppid() != parent_pid:
            break
    os._exit(0)  # the workers of a uni executor are in this process; Ray actors we own die with us


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conn-fd", type=int, required=True)
    parser.add_argument("--clock-fd", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="pagedserve-core-parent", daemon=True).start()

    # Imported after the watcher starts: importing torch takes seconds.
    from pagedserve.engine.core import messages
    from pagedserve.engine.core.engine_core import EngineCore
    from pagedserve.engine.core.messages import CoreFailed, CoreReady, StartCore
    from pagedserve.engine.core.model_setup import resolve_core_model_config
    from pagedserve.engine.core.step_clock import StepClock
    from pagedserve.workers.cpu_binding import mark_engine_process

    mark_engine_process()  # this process exists to run the engine: cpu_omp_threads_bind 'auto' may bind here
    conn = Connection(args.conn_fd)
    clock = StepClock(args.clock_fd)
    start: StartCore = messages.recv(conn)
    try:
        if start.ray_address is not None:
            import ray

            ray.init(address=start.ray_address, namespace=start.ray_namespace, log_to_driver=False)
        core = EngineCore(start.config, resolve_core_model_config(start.config), start.placement)
    except BaseException as error:
        logger.exception("the engine core could not start")
        messages.send(conn, CoreFailed(_picklable(error)))
        return 1
    try:
        messages.send(conn, CoreReady(core.model_config, core.num_kv_blocks))
        run_busy_loop(core, conn, clock)
    finally:
        core.shutdown()
    return 0


def run_busy_loop(core: EngineCore, conn: Connection, clock: StepClock) -> None:
    """Returns on ShutdownCore, when the front end's end closes, or once the core died (after
    sending the step that says so)."""
    from pagedserve.engine.core import messages

    while _take_messages(core, conn):
        if not core.has_work():
            continue
        clock.start(time.monotonic())
        try:
            step = core.step()
        finally:
            clock.stop()
        messages.send(conn, step)
        if step.dead_reason is not None:
            return


def _take_messages(core: EngineCore, conn: Connection) -> bool:
    """Handle every message waiting; with no work, block until one comes. False: leave."""
    from pagedserve.engine.core import messages
    from pagedserve.engine.core.messages import ShutdownCore

    try:
        while True:
            report = core.idle_report()
            if report is not None:
                messages.send(conn, report)
            if not conn.poll(0 if core.has_work() else None):
                return True
            message = messages.recv(conn)
            if isinstance(message, ShutdownCore):
                return False
            core.handle(message)
    except (EOFError, OSError):  # the front end is gone
        return False


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown, which took about a second here after the engine
    had already released everything (measured): a draining replica waits for its core to exit.
    The exit handlers still run (`ray.shutdown` where the core joined Ray)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
