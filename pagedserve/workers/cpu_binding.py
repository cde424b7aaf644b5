"""Which CPUs the model's torch threads run on (`EngineConfig.cpu_omp_threads_bind`, after vLLM's
VLLM_CPU_OMP_THREADS_BIND): one thread to one CPU, where the engine has a process of its own.

Unbound, a busy process beside the engine on one core of two made GNU OpenMP's spinning threads
share the other core at times, and each op then waited out a time slice: a 128-token prefill
took 2.7-3.1 s against 85 ms alone, a one-row decode step 0.76-0.97 s against 14 ms; bound,
307-318 and 46-49 ms beside the same neighbour, level alone; served at 1 req/s beside it, TTFT p99
1.12 against 15.0 s (2-core Zen 4; benchmarks/results/thread_binding_zen4/, docs/benchmarks.md).

A bound thread's new threads inherit its one CPU, so the engine starts its helper threads (grammar
compiles, llguidance's fill threads, the LoRA reader) on the process's CPUs: `unbound()` around
the start, or `release_current_thread()` first thing in the new thread."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

from pagedserve.cpu_list import parse_rank_cpu_lists

logger = logging.getLogger(__name__)

NO_BINDING = "nobind"
_state: dict[str, frozenset[int] | bool] = {}  # "process_cpus" once bound; "engine_process"


def mark_engine_process() -> None:
    """This process exists to run the engine (the engine core process): 'auto' may bind here."""
    _state["engine_process"] = True


def cpus_to_bind(setting: str, threads: int, rank: int = 0) -> list[int] | None:
    """The CPUs for the step thread's team of `threads` on rank `rank`, or None to leave them
    unbound. A CPU list per rank ('0-3|4-7') gives rank i the i-th. 'auto' binds only in the
    engine's own process and only where its threads are exactly the CPUs the process may use
    (Ray's num_cpus, a cgroup's cpuset, taskset): then binding is a permutation, and no other
    engine process can be counting on the same CPUs. (Ray's worker ranks never bind on 'auto':
    Ray reserves their CPUs by count, not by id, so nothing says which are theirs.)"""
    if setting == NO_BINDING:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if setting != "auto":
        lists = parse_rank_cpu_lists(setting)
        if rank >= len(lists):
            raise ValueError(f"cpu_omp_threads_bind {setting!r} has {len(lists)} CPU list(s): none for rank {rank}")
        cpus = lists[rank]
        if len(cpus) != threads:
            whose = f" of rank {rank}" if len(lists) > 1 else ""
            raise ValueError(f"cpu_omp_threads_bind {setting!r} names {len(cpus)} CPUs for {threads} torch threads{whose}: name one CPU a thread")
        if not set(cpus) <= set(allowed):
            raise ValueError(f"cpu_omp_threads_bind {setting!r}: this process may run only on CPUs {allowed}")
        return cpus
    return allowed if _state.get("engine_process") and threads >= 2 and threads == len(allowed) else None


def bind_step_threads(setting: str, threads: int, rank: int = 0) -> list[int] | None:
    """Binds the calling thread's torch team of `threads` (it included); the CPUs, or None."""
    from pagedserve.kernels import native_build

    cpus = cpus_to_bind(setting, threads, rank)
    if cpus is None:
        return None
    if not native_build.load():
        logger.warning("cpu_omp_threads_bind %r: the native kernels did not build, so torch's threads stay unbound", setting)
        return None
    _state.setdefault("process_cpus", frozenset(os.sched_getaffinity(0)))
    torch.ops.pagedserve_cpu.bind_omp_threads(cpus)
    logger.info("torch's %d threads bound to CPUs %s (rank %d, cpu_omp_threads_bind %r)", threads, cpus, rank, setting)
    return cpus


def release_current_thread() -> None:
    """The calling thread may run on every CPU the process had before binding (a no-op unbound)."""
    cpus = _state.get("process_cpus")
    if cpus:
        os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def unbound() -> Iterator[None]:
    """The calling thread on the process's CPUs for the block (threads started in it inherit them),
    then back on its own."""
    cpus = _state.get("process_cpus")
    if not cpus:  # nothing bound: nothing to undo
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)
