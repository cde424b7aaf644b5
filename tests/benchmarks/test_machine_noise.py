"""machine_noise.py: the CPU accounting that says whether a benchmark point ran alone, and the
speed probe that says whether the machine's speed moved between two servers' runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import machine_noise  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
# Burns `sys.argv[1]` CPU seconds, then stays alive a while (a live process's CPU seconds are read).
BURNER = "import sys, time\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\ntime.sleep(4)\n"
# A server whose work runs in a child of its own session, as pagedserve's engine core does.
SERVER = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {BURNER!r}, '1.0'], start_new_session=True).wait()\n"


def fake_stat(pid: int, comm: str, ppid: int, utime: int, stime: int) -> str:
    # /proc/PID/stat: pid (comm) state ppid pgrp session ... utime (14) stime (15) ...
    return f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0\n"


def test_the_trees_are_their_roots_and_descendants_only(tmp_path):
    def write(pid, comm, ppid, utime, stime):
        (tmp_path / str(pid)).mkdir(exist_ok=True)
        (tmp_path / str(pid) / "stat").write_text(fake_stat(pid, comm, ppid, utime, stime))

    write(10, "pagedserve", 1, 300, 100)
    write(11, "raylet", 10, 50, 50)
    write(12, "ray::Serve Replica) x", 11, 200, 0)  # a command with a space and a parenthesis
    write(13, "other", 1, 900, 0)
    write(20, "vllm bench", 1, 5, 0)
    (tmp_path / "self").mkdir()  # not a pid: skipped
    (tmp_path / "14").mkdir()  # exited between the listing and the read: skipped
    trees = machine_noise.ProcessTrees({"server": 10, "client": 20}, tmp_path)
    trees.sample()
    assert trees.ticks == {10: 400, 11: 100, 12: 200, 20: 5}
    assert trees.owner == {10: "server", 11: "server", 12: "server", 20: "client"}
    write(12, "ray::Serve Replica) x", 11, 260, 0)  # it ran on
    write(15, "engine core", 12, 7, 0)  # born since, under the server
    (tmp_path / "11" / "stat").unlink()  # gone: its last reading stays counted
    trees.sample()
    assert trees.ticks == {10: 400, 11: 100, 12: 260, 15: 7, 20: 5}
    assert machine_noise.ProcessTrees({"server": 0}, tmp_path).roots == {}  # no server


def test_a_child_whose_pid_wrapped_around_below_its_parents_is_in_the_tree(tmp_path):
    """Once the pid counter wraps, a process's child can have the smaller pid (on a Zen 3 after
    hours of tests: an engine core, pid 312, under its replica, pid 32735)."""
    def write(pid, comm, ppid):
        (tmp_path / str(pid)).mkdir(exist_ok=True)
        (tmp_path / str(pid) / "stat").write_text(fake_stat(pid, comm, ppid, 10, 0))

    write(32480, "pagedserve", 1)
    write(32551, "raylet", 32480)
    write(32735, "ray::ServeReplica", 32551)
    write(312, "engine core", 32735)
    write(5, "grandchild", 312)
    write(300, "other", 1)
    write(7, "other's child", 300)
    trees = machine_noise.ProcessTrees({"server": 32480}, tmp_path)
    trees.sample()
    assert set(trees.owner) == {32480, 32551, 32735, 312, 5}
    write(2, "born since, under the wrapped child", 312)
    trees.sample()
    assert set(trees.owner) == {32480, 32551, 32735, 312, 5, 2}


def test_machine_cpu_counts_busy_and_steal_apart():
    stat = "cpu  100 20 30 5000 7 1 2 40 0 0\ncpu0 50 10 15 2500 3 0 1 20 0 0\n"
    assert machine_noise.read_machine_cpu(stat) == (153 / TICK, 40 / TICK)
    busy, steal = machine_noise.read_machine_cpu()
    assert busy > 0 and steal >= 0


def test_a_point_beside_another_process_is_flagged_and_the_servers_cpu_is_not_counted_as_others():
    server = subprocess.Popen([sys.executable, "-c", SERVER], start_new_session=True)
    outsider = None
    try:
        watch = machine_noise.CpuWatch(server.pid)
        time.sleep(1.5)
        alone = watch.finish()
        # its child, in a session of its own, burned a second (and the interpreters' starts), once
        assert 0.8 <= alone["server_cpu_s"] <= 1.4, alone

        outsider = subprocess.Popen([sys.executable, "-c", BURNER, "1.0"])  # no descendant of the server
        watch = machine_noise.CpuWatch(server.pid)
        time.sleep(1.5)
        beside = watch.finish()
        assert beside["others_cpu_s"] >= 0.8 and beside["disturbed"], beside
    finally:
        for process in (server, outsider):  # the server's child ends by itself
            if process is not None:
                process.kill()
                process.wait()


def test_a_run_counts_its_childrens_cpu_though_they_exit_unwaited():
    """An offline run whose engine process is killed, not waited for (vLLM's is so): its CPU is the
    run's, not others', up to the watch's last sample of it."""
    run = f"import os, subprocess, sys, time\nchild = subprocess.Popen([sys.executable, '-c', {BURNER!r}, '1.0'])\ntime.sleep(1.3)\nchild.kill()\nos._exit(0)\n"
    done, cpu = machine_noise.run_watched([sys.executable, "-c", run], 0, timeout=30, label="[offline] test")
    assert done.returncode == 0
    assert cpu["client_cpu_s"] >= 0.5 and cpu["server_cpu_s"] == 0.0, cpu


def test_the_summary_names_the_drift_and_the_disturbed_runs(capsys):
    quiet = {"wall_s": 10.0, "others_cpu_s": 0.1, "disturbed": False}
    noise = {
        "offline": {"pagedserve": {"speed_probe_gflops": [100.0, 102.0], "cpu": quiet}, "vllm": {"speed_probe_gflops": [101.0, 99.0], "cpu": quiet}},
        "online": {
            "pagedserve": {"speed_probe_gflops": [100.0, 125.0], "points": {"c1": quiet, "c16": {**quiet, "others_cpu_s": 3.0, "disturbed": True}}},
            "vllm": {"speed_probe_gflops": [110.0, 111.0], "points": {"c1": quiet, "c16": quiet}},
        },
    }
    machine_noise.summarize(noise)
    assert noise["offline_probe_drift"] == round(102 / 99 - 1, 3) and noise["online_probe_drift"] == 0.25
    assert noise["disturbed"] == ["online pagedserve c16"]
    err = capsys.readouterr().err
    assert "[online] the machine's speed moved 25%" in err and "[offline]" not in err
    assert machine_noise.probe_drift([100.0]) is None
    assert machine_noise.speed_probe(seconds=0.05, size=128) > 0
