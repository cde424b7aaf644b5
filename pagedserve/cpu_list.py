"""CPU lists as Linux and vLLM write them ('0-3,8'): the config validates one, the workers bind
threads to one."""

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
