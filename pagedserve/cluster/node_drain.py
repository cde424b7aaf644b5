"""Drain the LLMServer replicas of this node before it stops: `python -m
pagedserve.cluster.node_drain [--timeout-s S] [--app NAME]`, the Helm chart's preStop hook before
`ray stop`.

`ray stop`, and a pod's deletion behind it, end every Ray process on the node at once, so a
replica's streams would end with an error. Run first, this sends each local LLMServer replica
the SIGTERM its drain answers (replica_drain.py): it hands its streams over to replicas on other
nodes at once, refuses new requests, and exits when none is left (or after its `drain_timeout_s`).
This waits for them to exit, up to `--timeout-s`, then returns; it never kills anything itself.

Replicas are found by the process title Ray gives an actor's worker: `ray::ServeReplica:<app>:
<deployment>`, followed by the method it runs, if any.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import time

import psutil

from pagedserve.cluster.app import SERVER_DEPLOYMENT

logger = logging.getLogger("pagedserve.cluster.node_drain")

POLL_S = 0.5


def local_replicas(app: str | None = None) -> list[psutil.Process]:
    """This node's LLMServer replica processes: of `app`, or of every app."""
    app_pattern = re.escape(app) if app is not None else r"[^:\s]*"
    title = re.compile(rf"^ray::ServeReplica:{app_pattern}:{re.escape(SERVER_DEPLOYMENT)}(?:[.\s]|$)")
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if title.match(" ".join(process.info["cmdline"] or [])) and process.pid != os.getpid():
            found.append(process)
    return found


def drain(timeout_s: float, app: str | None = None) -> int:
    """SIGTERM every local replica (of `app`, or of every app), then wait for them to exit;
    returns how many were still running when the time was up."""
    replicas = local_replicas(app)
    for process in replicas:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    logger.info("draining %d LLMServer replica(s): %s", len(replicas), [p.pid for p in replicas])
    deadline = time.monotonic() + timeout_s
    while replicas and time.monotonic() < deadline:
        replicas = [p for p in replicas if _is_running(p)]
        if replicas:
            time.sleep(POLL_S)
    if replicas:
        logger.warning("%d replica(s) still running after %.0f s: %s", len(replicas), timeout_s, [p.pid for p in replicas])
    return len(replicas)


def _is_running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="how long to wait for the replicas to exit")
    parser.add_argument("--app", help="only this Serve application's replicas (default: every app's)")
    args = parser.parse_args(argv)
    if args.timeout_s < 0:
        parser.error(f"--timeout-s must be >= 0, got {args.timeout_s}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    drain(args.timeout_s, args.app)
    return 0  # the node stops either way: a preStop hook that fails only delays it


if __name__ == "__main__":
    sys.exit(main())
