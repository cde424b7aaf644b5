"""CPU lists as Linux and vLLM write them ('0-3,8'), and one per rank as vLLM's
VLLM_CPU_OMP_THREADS_BIND writes them ('0-3|4-7'): the config validates them, the workers bind
threads to them."""

from __future__ import annotations

import re


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8], in the order given; a CPU named twice is an error."""
    cpus: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ValueError(f"{text!r} is not a CPU list: CPU ids and ranges such as '0-3,8'")
        cpus += range(int(match[1]), int(match[2] or match[1]) + 1)
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"CPU list {text!r} names a CPU twice: each thread needs a CPU of its own")
    return cpus


def parse_rank_cpu_lists(text: str) -> list[list[int]]:
    """'0-3|4-7' -> [[0, 1, 2, 3], [4, 5, 6, 7]]: rank i's CPUs are the i-th list ('0-3' is one)."""
    return [parse_cpu_list(part) for part in text.split("|")]
