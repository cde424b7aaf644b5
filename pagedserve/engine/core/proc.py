"""The engine core process's entry point: `python -m pagedserve.engine.core.proc --conn-fd N
--clock-fd M`, started by EngineCoreClient with one end of a socket pair and the step clock.

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
from multiprocessing.connection import Connection

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
    from pagedserve.engine.core.step_clock import StepClock
    from pagedserve.engine.llm_engine import LLMEngine

    conn = Connection(args.conn_fd)
    clock = StepClock(args.clock_fd)
    start: StartCore = messages.recv(conn)
    try:
        if start.ray_address is not None:
            import ray

            ray.init(address=start.ray_address, namespace=start.ray_namespace, log_to_driver=False)
        engine = LLMEngine(start.config, start.placement)
    except BaseException as error:
        logger.exception("the engine core could not start")
        messages.send(conn, CoreFailed(_picklable(error)))
        return 1
    try:
        messages.send(conn, CoreReady(engine.model_config, engine.num_kv_blocks))
        EngineCore(engine).run(conn, clock)
    finally:
        engine.shutdown()
    return 0


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
