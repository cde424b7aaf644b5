"""What every benchmark script shares: where a result came from (commit, machine, command line),
writing the JSON, timing a call, random token prompts, and running a script against a baseline
commit ("this tree against a baseline" in one run, so the ratio holds on a noisy machine).

Standard library only at import time: `peers/offline_run.py` runs under the peer venv, which has
no pagedserve, and the tools under `tools/` import it too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parent.parent


# "COMMIT TREE" (`git rev-parse HEAD HEAD^{tree}` where the files were copied from): for a copy of the
# files whose repository is not theirs, as on the lent GPU machine, where the working tree arrives
# over a clone of the last landed commit (tools/gpu_check.sh). Believed only if the files are TREE.
SOURCE_ENV = "PAGEDSERVE_SOURCE"


def git(*args: str, env: dict[str, str] | None = None) -> str:
    """`git -C REPO ...`'s output, stripped; '' when git or the repository is missing."""
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, env={**os.environ, **(env or {})})
    return done.stdout.strip() if done.returncode == 0 else ""


def files_tree() -> str:
    """The git tree of the files on disk, tracked or not (ignored ones aside): a commit's tree
    exactly when they are that commit's files. Built in a scratch index, so the repository's own
    index is untouched. '' without git."""
    with tempfile.TemporaryDirectory() as scratch:
        index = {"GIT_INDEX_FILE": os.path.join(scratch, "index")}
        git("add", "--all", env=index)
        return git("write-tree", env=index)


def commit_info() -> dict:
    """The commit measured, whether the tracked files differed from it (a dirty figure is a scratch
    one), and the files' tree. With SOURCE_ENV set and the files exactly its tree, its commit."""
    tree = files_tree()
    source = os.environ.get(SOURCE_ENV, "").split()
    if len(source) == 2 and tree and source[1] == tree:
        return {"commit": source[0], "is_dirty": False, "tree": tree}
    is_dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": git("rev-parse", "HEAD") or "unknown", "is_dirty": is_dirty, "tree": tree}


def cpu_info(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and flags (from /proc/cpuinfo; `lscpu` where that file is missing)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    flags = fields.get("flags", "").split()
    return {"cpu": fields.get("model name", "unknown"), "num_cpus": os.cpu_count(), "cpu_flags": sorted(flags),
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags}


def machine_info() -> dict:
    """The CPU, the core count, whether it has the bf16 instructions, and the load now."""
    return {**cpu_info(), "load_before": list(os.getloadavg()), "started_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def provenance(argv: list[str] | None = None) -> dict:
    """What a result JSON records about its own making: commit, machine, command line."""
    command = [sys.executable, *sys.argv] if argv is None else [sys.executable, sys.argv[0], *argv]
    return {**commit_info(), "machine": machine_info(), "command": command}


def write_report(report: dict, output: Path | str | None, argv: list[str] | None = None, indent: int = 2) -> str:
    """Adds `provenance` to `report` (in place), prints it as JSON and writes it to `output`."""
    report.setdefault("provenance", provenance(argv))
    report["provenance"]["load_after"] = list(os.getloadavg())  # lists, so the dict equals its JSON
    text = json.dumps(report, indent=indent)
    print(text)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text + "\n")
    return text


def _timed_calls(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` on `clock`, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


# A child that burns a millisecond of CPU at a time, then sleeps: `fraction` of one core in all.
_BURNER = """
import sys, time
burn, sleep = 1e-3, 1e-3 * (1 / float(sys.argv[1]) - 1)
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < burn:
        pass
    time.sleep(sleep)
"""


def background_load_error(fraction: float) -> str | None:
    """What is wrong with a background load of `fraction`, or None: the scripts' flag checks it
    where it is read, `background_load` where it is used."""
    return None if 0 <= fraction < 1 else f"background load {fraction}: a fraction of one core, at least 0 and below 1"


@contextlib.contextmanager
def background_load(fraction: float) -> Iterator[None]:
    """Another process taking `fraction` (0 to 1) of one core in 1 ms bursts while the block runs:
    what a server's other processes (its proxy, Ray's raylet and controller) take from the model's
    threads on a small machine. 0 starts nothing."""
    error = background_load_error(fraction)
    if error:
        raise ValueError(error)
    if fraction == 0:
        yield
        return
    burner = subprocess.Popen([sys.executable, "-c", _BURNER, str(fraction)])
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


def least_ms(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.thread_time) -> float:
    """The least time of `repeats` calls after a warm-up, in ms. The default clock is this
    thread's CPU time: other processes only ever add to it, so it holds on a loaded machine."""
    return round(min(_timed_calls(fn, repeats, clock)) * 1e3, 3)


def median_ms(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The median wall time of `repeats` calls after a warm-up, in ms."""
    return round(statistics.median(_timed_calls(fn, repeats, clock)) * 1e3, 3)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def random_token_prompts(num: int, low: int, high: int, seed: int = 0, vocab: tuple[int, int] = (100, 10_000)) -> list[list[int]]:
    """`num` prompts of random token ids in `vocab`, each of a random length in [low, high]."""
    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(rng.randint(low, high))] for _ in range(num)]


def parse_range(text: str) -> tuple[int, int]:
    """'MIN:MAX' -> (MIN, MAX)."""
    low, high = map(int, text.split(":"))
    return low, high


def positive_ints(text: str) -> tuple[int, ...]:
    """'1,2,8' -> (1, 2, 8): an argparse type, so a bad list is a usage error naming the flag."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers of at least 1, got {text!r}")
    return values


def default_baseline() -> str:
    """The commit to measure against when none is given: where this branch left `main` (their
    merge-base) when HEAD is not on `main`, else the commit before HEAD (`HEAD~`)."""
    head = git("rev-parse", "HEAD")
    base = git("merge-base", "HEAD", "main")
    return base if base and base != head else git("rev-parse", "HEAD~")


def add_baseline_argument(parser) -> None:
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="the commit to compare with (default: the merge-base with main, or HEAD~ on main)")


@contextlib.contextmanager
def baseline_tree(rev: str | None) -> Iterator[tuple[str, Path]]:
    """`rev`'s `pagedserve/` (and `tests/`, which some scripts import), `git archive`d into a
    temporary folder; yields (full commit, folder)."""
    commit = git("rev-parse", "--verify", f"{rev or default_baseline()}^{{commit}}")
    if not commit:
        raise SystemExit(f"--baseline {rev!r} is not a commit of {REPO}")
    with tempfile.TemporaryDirectory() as folder:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "pagedserve", "tests"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
        yield commit, Path(folder)


def run_in_tree(tree: Path, script: str, argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 3600) -> object:
    """Runs `script argv` in a fresh interpreter with `tree` first on PYTHONPATH (so it imports
    that tree's pagedserve) and returns the JSON of its last stdout line."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": f"{tree}{os.pathsep}{REPO}", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, script, *argv], env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{script} under {tree} failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
