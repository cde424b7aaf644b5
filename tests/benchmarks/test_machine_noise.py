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
# Burns `sys.argv[1]` CPU seconds, then stays alive (its CPU seconds are read while it lives).
BURNER = "import sys, time\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\ntime.sleep(60)\n"


def fake_stat(pid: int, comm: str, session: int, utime: int, stime: int) -> str:
    # /proc/PID/stat: pid (comm) state ppid pgrp session ... utime (14) stime (15) ...
    return f"{pid} ({comm}) S 1 {pid} {session} 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0\n"


def test_session_cpu_sums_the_sessions_processes_only(tmp_path):
    for pid, comm, session, utime, stime in [(10, "ray::Serve Replica) x", 10, 300, 100), (11, "raylet", 10, 50, 50), (12, "other", 99, 900, 0)]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(fake_stat(pid, comm, session, utime, stime))
    (tmp_path / "self").mkdir()  # not a pid: skipped
    (tmp_path / "13").mkdir()  # exited between the listing and the read: skipped
    assert machine_noise.session_cpu(10, tmp_path) == 500 / TICK
    assert machine_noise.session_cpu(99, tmp_path) == 900 / TICK
    assert machine_noise.session_cpu(0, tmp_path) == 0.0  # no server: not the kernel's threads


def test_machine_cpu_counts_busy_and_steal_apart():
    stat = "cpu  100 20 30 5000 7 1 2 40 0 0\ncpu0 50 10 15 2500 3 0 1 20 0 0\n"
    assert machine_noise.read_machine_cpu(stat) == (153 / TICK, 40 / TICK)
    busy, steal = machine_noise.read_machine_cpu()
    assert busy > 0 and steal >= 0


def test_a_point_beside_another_process_is_flagged_and_the_servers_cpu_is_not_counted_as_others():
    server = subprocess.Popen([sys.executable, "-c", BURNER, "1.0"], start_new_session=True)
    outsider = None
    try:
        watch = machine_noise.CpuWatch(server.pid)
        time.sleep(1.5)
        alone = watch.finish()
        assert alone["server_cpu_s"] >= 0.8, alone  # the server's session burned its second
        # ... and it is not others' (which only the rest of the machine's background adds to)
        assert alone["others_cpu_s"] < alone["server_cpu_s"], alone

        outsider = subprocess.Popen([sys.executable, "-c", BURNER, "1.0"])  # this session: not the server's
        watch = machine_noise.CpuWatch(server.pid)
        time.sleep(1.5)
        beside = watch.finish()
        assert beside["others_cpu_s"] >= 0.8 and beside["disturbed"], beside
    finally:
        for process in (server, outsider):
            if process is not None:
                process.kill()
                process.wait()


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
