"""`cpu_omp_threads_bind`: which CPUs the model's torch threads run on (workers/cpu_binding.py).
Binding changes the calling process's threads, so the native op runs in a subprocess here;
tests/engine/core/test_core_proc.py finds a real engine core's team bound."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from pagedserve.config import EngineConfig
from pagedserve.cpu_list import parse_cpu_list
from pagedserve.workers import cpu_binding

CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="binding two threads to two CPUs needs two CPUs")


@pytest.mark.parametrize("text, cpus", [("3", [3]), ("0-3", [0, 1, 2, 3]), ("1,0", [1, 0]), (" 0 - 1 , 8", [0, 1, 8])])
def test_cpu_lists_read_as_linux_writes_them(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text, message", [("3-1", "not a CPU list"), ("a", "not a CPU list"), ("", "not a CPU list"), ("0,0-1", "names a CPU twice")])
def test_a_bad_cpu_list_is_refused_naming_what_is_allowed(text, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(cpu_omp_threads_bind=text)
    with pytest.raises(ValueError, match="'auto', or 'nobind'"):
        EngineConfig(cpu_omp_threads_bind=text)


def test_auto_binds_only_an_engine_process_whose_threads_are_its_cpus(monkeypatch):
    monkeypatch.setattr(cpu_binding, "_state", {})
    assert cpu_binding.cpus_to_bind("auto", len(CPUS)) is None  # a user's process: never
    cpu_binding.mark_engine_process()
    assert cpu_binding.cpus_to_bind("auto", len(CPUS)) == (CPUS if len(CPUS) >= 2 else None)
    assert cpu_binding.cpus_to_bind("auto", len(CPUS) + 1) is None  # more threads than CPUs
    assert cpu_binding.cpus_to_bind("auto", 1) is None
    assert cpu_binding.cpus_to_bind("nobind", len(CPUS)) is None


def test_a_cpu_list_binds_anywhere_but_needs_one_cpu_a_thread(monkeypatch):
    monkeypatch.setattr(cpu_binding, "_state", {})
    if len(CPUS) >= 2:
        assert cpu_binding.cpus_to_bind(f"{CPUS[1]},{CPUS[0]}", 2) == [CPUS[1], CPUS[0]]
    with pytest.raises(ValueError, match="names 2 CPUs for 3 torch threads"):
        cpu_binding.cpus_to_bind("0-1", 3)
    missing = max(CPUS) + 1
    with pytest.raises(ValueError, match=re.escape(f"may run only on CPUs {CPUS}")):
        cpu_binding.cpus_to_bind(f"{CPUS[0]},{missing}", 2)


def test_each_rank_takes_its_own_list(monkeypatch):
    monkeypatch.setattr(cpu_binding, "_state", {})
    first, last = CPUS[0], CPUS[-1]
    assert cpu_binding.cpus_to_bind(f"{last}|{first}", 1, rank=0) == [last]
    assert cpu_binding.cpus_to_bind(f"{last}|{first}", 1, rank=1) == [first]
    with pytest.raises(ValueError, match="names 1 CPUs for 2 torch threads of rank 1"):
        cpu_binding.cpus_to_bind(f"{last}|{first}", 2, rank=1)
    with pytest.raises(ValueError, match="none for rank 2"):
        cpu_binding.cpus_to_bind(f"{last}|{first}", 1, rank=2)


@pytest.mark.parametrize("setting, tp, pp", [("0|1", 2, 1), ("0-1|2-3|4|5", 2, 2), ("0-3", 1, 1), ("auto", 4, 1), ("nobind", 2, 2)])
def test_a_list_per_rank_is_one_per_rank(setting, tp, pp):
    config = EngineConfig(model="demo", cpu_omp_threads_bind=setting, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert config.cpu_omp_threads_bind == setting


@pytest.mark.parametrize(
    "setting, tp, message",
    [
        ("0-1", 2, re.escape("has 1 CPU list(s) for tensor_parallel_size x pipeline_parallel_size = 2 ranks")),  # two ranks, one list
        ("0|1", 1, re.escape("has 2 CPU list(s) for tensor_parallel_size x pipeline_parallel_size = 1 ranks")),
        ("0|1-x", 2, "not a CPU list.*" + re.escape("one such list per rank, '|' between them")),
        ("0||1", 3, "not a CPU list"),
    ],
)
def test_a_list_per_rank_that_does_not_fit_the_ranks_is_refused(setting, tp, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="demo", cpu_omp_threads_bind=setting, tensor_parallel_size=tp)


BIND_AND_LOOK = """
import json, os, sys, threading, torch
from pagedserve.workers import cpu_binding
cpus = json.loads(sys.argv[1])
torch.set_num_threads(len(cpus))
bound = cpu_binding.bind_step_threads(",".join(map(str, cpus)), len(cpus))
torch.randn(512, 512) @ torch.randn(512, 512)  # torch's own parallel op, on the same team
team = torch.ops.pagedserve_cpu.omp_team_tids(len(cpus))
seen = {}
def look(name):
    seen[name] = sorted(os.sched_getaffinity(0))
def start(name, release=False):
    def run():
        if release:
            cpu_binding.release_current_thread()
        look(name)
    thread = threading.Thread(target=run); thread.start(); thread.join()
start("inherited")
start("released", release=True)
with cpu_binding.unbound():
    start("started unbound")
look("step thread after")
print(json.dumps({"bound": bound, "team": [sorted(os.sched_getaffinity(t)) for t in team], "seen": seen}))
"""


@needs_two_cpus
def test_the_team_is_bound_and_helper_threads_get_every_cpu_back():
    cpus = [CPUS[-1], CPUS[0]]
    done = subprocess.run([sys.executable, "-c", BIND_AND_LOOK, json.dumps(cpus)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bound"] == cpus
    assert result["team"] == [[cpus[0]], [cpus[1]]]  # thread t on cpus[t], the step thread first
    assert result["seen"] == {
        "inherited": [cpus[0]],  # why the engine's helper threads release themselves
        "released": CPUS,
        "started unbound": CPUS,
        "step thread after": [cpus[0]],
    }
