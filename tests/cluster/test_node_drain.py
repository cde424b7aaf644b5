"""`python -m pagedserve.cluster.node_drain`, the chart's preStop hook: it SIGTERMs this node's
LLMServer replicas (found by the process titles Ray gives them; test_drain_sigterm.py checks that
against a live Serve app) and waits for them to exit, touching no other process.

Here the replicas are stand-ins titled as Ray titles them, so the hook's own logic is what is
tested: which processes it signals, and how it waits. Each call names the stand-ins' app (`app=`),
so the session's real replicas are never touched; one case checks the every-app match."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from pagedserve.cluster import node_drain

# A stand-in: exits a moment after SIGTERM (a replica's drain), or ignores it. Each says "ready"
# once its handler is in place: a SIGTERM before that would end it by the default action.
DRAINS = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), sys.exit(0))); print('ready', flush=True); time.sleep(120)"
IGNORES = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"


def titled(title: str, code: str) -> subprocess.Popen:
    process = subprocess.Popen(["bash", "-c", f'exec -a "{title}" {sys.executable} -c "{code}"'], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n", "the stand-in exited before it was ready"
    assert " ".join(psutil.Process(process.pid).cmdline()).startswith(title), "the stand-in did not take its title"
    return process


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield lambda title, code=DRAINS: started.append(titled(title, code)) or started[-1]
    for process in started:
        process.kill()
        process.wait()


APP = "node-drain-test"


def test_drains_every_local_replica_and_nothing_else(processes):
    replicas = [processes(f"ray::ServeReplica:{APP}:LLMServer.handle_request_streaming"), processes(f"ray::ServeReplica:{APP}:LLMServer")]
    others = [
        processes(f"ray::ServeReplica:{APP}:OpenAIIngress"),
        processes(f"ray::ServeReplica:{APP}:LLMServerX"),
        processes(f"ray::ServeReplica:{APP}-2:LLMServer"),  # another app
        processes("LLMServer"),
    ]
    assert node_drain.drain(timeout_s=30, app=APP) == 0
    assert all(p.poll() == 0 for p in replicas)  # each exited by its own SIGTERM handler
    assert all(p.poll() is None for p in others)


def test_without_an_app_it_finds_every_apps_replicas(processes):
    mine = {processes(f"ray::ServeReplica:{APP}:LLMServer").pid, processes(f"ray::ServeReplica:{APP}-2:LLMServer.generate").pid}
    assert mine <= {p.pid for p in node_drain.local_replicas()}


def test_gives_up_after_the_timeout_without_killing(processes):
    stubborn = processes(f"ray::ServeReplica:{APP}:LLMServer", IGNORES)
    started = time.monotonic()
    assert node_drain.drain(timeout_s=1.0, app=APP) == 1
    assert 1.0 <= time.monotonic() - started < 10
    assert stubborn.poll() is None


def test_a_negative_timeout_is_refused(capsys):
    with pytest.raises(SystemExit):
        node_drain.main(["--timeout-s", "-1"])
    assert "--timeout-s must be >= 0" in capsys.readouterr().err
