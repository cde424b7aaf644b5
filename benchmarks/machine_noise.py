"""How fast the machine ran and what else ran on it while a benchmark point was timed.

These machines are shared VMs whose speed drifts: the same float32 GEMM has run at 80 and at 141
GFLOP/s ten minutes apart on a 2-core Zen 3, and a side-by-side run compares two servers that ran
minutes apart. A process of someone else's (a test suite, a kernel build) on one of two cores
halves a point's throughput. So each result records both, and a ratio can be read with them:

- `speed_probe()`: the GFLOP/s of a fixed float32 matmul on every core, the best of a few passes,
  taken before and after each engine's run (nothing of the benchmark running). Probes more than
  PROBE_DRIFT apart say the machine's speed moved across the runs.
- `CpuWatch` (`run_watched`): over one timed run, the machine's busy CPU seconds (/proc/stat),
  less those of the processes the benchmark owns: the server's process tree (`server_cpu_s`), the
  client's (`client_cpu_s`: the load client, or an offline run, which has no server) and the
  harness (`harness_cpu_s`). What is left is other processes' (`others_cpu_s`); `steal_s` is what
  the hypervisor gave to other guests.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

# Probes further apart than this (the larger over the smaller, less one) flag the run.
PROBE_DRIFT = 0.10
# Other processes' CPU above this share of one core over a point flag the point.
OTHERS_CORE_SHARE = 0.05
# How often a CpuWatch reads its process trees (each read about a millisecond of CPU).
SAMPLE_S = 0.5
_TICK = os.sysconf("SC_CLK_TCK")


def speed_probe(seconds: float = 1.0, size: int = 384) -> float:
    """GFLOP/s of `size` x `size` float32 matmuls on torch's threads: the best pass of about
    `seconds` / 5 each. Small enough to stay in cache, so it reads the cores' speed, not memory's."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    flops = 2 * size**3
    torch.mm(a, b, out=out)
    calls = max(1, int(seconds / 5 * 100e9 / flops))  # about seconds / 5 a pass at 100 GFLOP/s
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b, out=out)
        best = min(best, (time.perf_counter() - start) / calls)
    return round(flops / best / 1e9, 1)


def probe_drift(probes: list[float]) -> float | None:
    """The largest probe over the smallest, less one (None with fewer than two)."""
    values = [value for value in probes if value]
    return round(max(values) / min(values) - 1, 3) if len(values) > 1 else None


def warn_if_disturbed(cpu: dict, label: str) -> dict:
    """`cpu` (a CpuWatch's finish()), after saying on stderr if other processes disturbed it."""
    if cpu["disturbed"]:
        print(f"{label}: other processes used {cpu['others_cpu_s']} CPU s in {cpu['wall_s']} s: disturbed", file=sys.stderr, flush=True)
    return cpu


def summarize(noise: dict) -> None:
    """Adds to compare_vllm's `noise` ({"offline": {engine: run}, "online": {engine: run}}) each
    section's probe drift over its engines' runs and the list of disturbed runs; warns of both."""
    disturbed = []
    for section in ("offline", "online"):
        runs = noise.get(section, {})
        drift = noise[f"{section}_probe_drift"] = probe_drift([p for run in runs.values() for p in run["speed_probe_gflops"]])
        if drift is not None and drift > PROBE_DRIFT:
            probes = {engine: run["speed_probe_gflops"] for engine, run in runs.items()}
            print(f"[{section}] the machine's speed moved {drift:.0%} across the engines' runs ({probes} GFLOP/s): read the ratios with it", file=sys.stderr)
        for engine, run in runs.items():
            cpus = {"": run["cpu"]} if "cpu" in run else run["points"]
            disturbed += [f"{section} {engine} {point}".strip() for point, cpu in cpus.items() if cpu["disturbed"]]
    noise["disturbed"] = disturbed


def read_machine_cpu(stat: str | None = None) -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat's first line."""
    line = (stat if stat is not None else Path("/proc/stat").read_text()).splitlines()[0]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in line.split()[1:9])
    return (user + nice + system + irq + softirq) / _TICK, steal / _TICK


def read_stat(path: Path) -> tuple[int, int] | None:
    """(parent pid, own CPU ticks: user and system) from a /proc/PID/stat; None once it is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command, which may hold spaces
    return int(fields[1]), int(fields[11]) + int(fields[12])  # stat's fields 4, 14 and 15


class ProcessTrees:
    """The processes under some roots (0 or less: none) and their CPU ticks, read again at each
    `sample()`. By descent, not by session: pagedserve's engine core and Ray's processes start
    sessions of their own. A sample reads the stat of the trees' processes and of processes new
    since the last one, so it costs about a millisecond, not a read of every process."""

    def __init__(self, roots: dict[str, int], proc: Path = Path("/proc")):
        self.roots = {pid: owner for owner, pid in roots.items() if pid > 0}
        self.proc = proc
        self.seen: set[int] = set()  # every live pid read once
        self.owner: dict[int, str] = {}  # the trees' pids (they stay counted once gone)
        self.ticks: dict[int, int] = {}  # a tree pid's ticks at its last sample
        self.gone: set[int] = set()

    def sample(self) -> None:
        live = {int(name) for name in os.listdir(self.proc) if name.isdigit()}
        self.seen &= live  # a pid gone may come back as another process
        parents = {}
        for pid in live - self.seen:
            self.seen.add(pid)
            stat = read_stat(self.proc / str(pid) / "stat")
            if stat is not None and pid not in self.owner:
                parents[pid] = stat[0]
        self._adopt(parents)
        for pid in self.owner:
            if pid not in live:
                self.gone.add(pid)  # its number may come back as another process's
            elif pid not in self.gone:
                stat = read_stat(self.proc / str(pid) / "stat")
                if stat is not None:
                    self.ticks[pid] = stat[1]

    def _adopt(self, parents: dict[int, int]) -> None:
        """Owns each new pid (-> its parent) that is a root or whose parent is owned, until no more
        are: not in pid order, since once the pids wrap around a child's pid can be the smaller
        (a server's engine core, pid 312 under its replica's 32735, read as others' before)."""
        while parents:
            adopted = [pid for pid, parent in parents.items() if pid in self.roots or parent in self.owner]
            if not adopted:
                return
            for pid in adopted:
                parent = parents.pop(pid)
                self.owner[pid] = self.roots.get(pid) or self.owner[parent]


def harness_cpu() -> float:
    """This process's CPU seconds (its sampling thread's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuWatch:
    """Over one timed run (a load point, an offline run): the machine's busy CPU seconds, less the
    benchmark's own. The benchmark owns the process trees under `server_pid` (0: none) and
    `client_pid` (the load client, or the offline run), sampled every `sample_s` from a thread,
    so a process that exits within the run counts up to its last sample (not every parent waits
    for its children, whose CPU would then be lost), and this process."""

    def __init__(self, server_pid: int, client_pid: int = 0, sample_s: float = SAMPLE_S, proc: Path = Path("/proc")):
        self.trees = ProcessTrees({"server": server_pid, "client": client_pid}, proc)
        self.wall = time.monotonic()
        self.busy, self.steal = read_machine_cpu()
        self.harness = harness_cpu()
        self.trees.sample()
        self.first = dict(self.trees.ticks)  # a process born later started at 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_done, args=(sample_s,), daemon=True)
        self._thread.start()

    def _sample_until_done(self, sample_s: float) -> None:
        while not self._done.wait(sample_s):
            self.trees.sample()

    def finish(self) -> dict:
        self._done.set()
        self._thread.join()
        self.trees.sample()
        wall = time.monotonic() - self.wall
        busy, steal = read_machine_cpu()
        owned = {"server": 0, "client": 0}
        for pid, ticks in self.trees.ticks.items():
            owned[self.trees.owner[pid]] += ticks - self.first.get(pid, 0)
        server, client = owned["server"] / _TICK, owned["client"] / _TICK
        harness = harness_cpu() - self.harness
        others = max(0.0, busy - self.busy - server - client - harness)
        return {
            "wall_s": round(wall, 1),
            "server_cpu_s": round(server, 1),
            "client_cpu_s": round(client, 1),
            "harness_cpu_s": round(harness, 1),
            "others_cpu_s": round(others, 1),
            "steal_s": round(steal - self.steal, 1),
            "disturbed": others > OTHERS_CORE_SHARE * wall,
        }


def run_watched(command: list[str], server_pid: int, timeout: float, label: str, **popen) -> tuple[subprocess.CompletedProcess, dict]:
    """subprocess.run(command, capture_output=True, text=True, timeout=timeout, **popen) with a
    CpuWatch over it (the command as the client): its result and the CPU accounting, said on
    stderr under `label` if the run was disturbed."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    watch = CpuWatch(server_pid, process.pid)
    try:
        out, err = process.communicate(timeout=timeout)
    except BaseException:
        process.kill()
        process.communicate()
        raise
    finally:
        cpu = watch.finish()
    return subprocess.CompletedProcess(command, process.returncode, out, err), warn_if_disturbed(cpu, label)
