"""How fast the machine ran and what else ran on it while a benchmark point was timed.

These machines are shared VMs whose speed drifts: the same float32 GEMM has run at 80 and at 141
GFLOP/s ten minutes apart on a 2-core Zen 3, and a side-by-side run compares two servers that ran
minutes apart. A process of someone else's (a test suite, a kernel build) on one of two cores
halves a point's throughput. So each result records both, and a ratio can be read with them:

- `speed_probe()`: the GFLOP/s of a fixed float32 matmul on every core, the best of a few passes,
  taken before and after each engine's run (nothing of the benchmark running). Probes more than
  PROBE_DRIFT apart say the machine's speed moved across the runs.
- `CpuWatch`: over one timed point, the machine's busy CPU seconds (/proc/stat), less those of the
  processes the benchmark owns: the server's process tree (`server_cpu_s`), the harness and the
  children it waited for (`client_cpu_s`: the load client, or an offline run, which has no
  server). What is left is other processes' (`others_cpu_s`); `steal_s` is what the hypervisor
  gave to other guests.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Probes further apart than this (the larger over the smaller, less one) flag the run.
PROBE_DRIFT = 0.10
# Other processes' CPU above this share of one core over a point flag the point.
OTHERS_CORE_SHARE = 0.05
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


def tree_cpu(root: int, proc: Path = Path("/proc")) -> float:
    """CPU seconds (user and system) of process `root` and its live descendants, with those of
    the children they have waited for (so a child that exits within an interval still counts).
    0 for a root of 0 or less: no server. By descent, not by session: pagedserve's engine core
    and Ray's processes start sessions of their own."""
    if root <= 0:
        return 0.0
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after the command, which may hold spaces
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)  # field 4 of stat: the parent
        ticks[pid] = sum(int(v) for v in fields[11:15])  # fields 14-17: utime, stime, cutime, cstime
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack += children.get(pid, [])
    return total / _TICK


def own_cpu() -> float:
    """This process's CPU seconds and those of its children it has waited for (the client)."""
    seconds = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        seconds += usage.ru_utime + usage.ru_stime
    return seconds


@dataclass
class CpuWatch:
    """Started before a point runs, `finish()`ed after it: the point's CPU accounting.
    `server_pid`: the server's process (0: none, as for an offline run, this process's child)."""

    server_pid: int
    wall: float = 0.0
    busy: float = 0.0
    steal: float = 0.0
    server: float = 0.0
    own: float = 0.0

    def __post_init__(self) -> None:
        self.wall = time.monotonic()
        self.busy, self.steal = read_machine_cpu()
        self.server, self.own = tree_cpu(self.server_pid), own_cpu()

    def finish(self) -> dict:
        wall = time.monotonic() - self.wall
        busy, steal = read_machine_cpu()
        server, own = tree_cpu(self.server_pid) - self.server, own_cpu() - self.own
        others = max(0.0, busy - self.busy - server - own)
        return {
            "wall_s": round(wall, 1),
            "server_cpu_s": round(server, 1),
            "client_cpu_s": round(own, 1),
            "others_cpu_s": round(others, 1),
            "steal_s": round(steal - self.steal, 1),
            "disturbed": others > OTHERS_CORE_SHARE * wall,
        }
