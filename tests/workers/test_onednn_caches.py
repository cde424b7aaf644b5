"""oneDNN's primitive caches are bounded in every pagedserve process (pagedserve/onednn_caches.py):
a packed linear run at hundreds of row counts, as a server's steps come, grows a process by a
bounded amount, where the caches' own defaults (1024 entries each) let it grow several times as
much. Each run is a fresh process: both caches read their capacity once, at their first use."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pagedserve import onednn_caches

SWEEP = """
import json, os, psutil, torch
import pagedserve  # bounds the caches, unless the environment already set them
from pagedserve.workers.layers import cpu_gemm
torch.set_num_threads(1)
weight = cpu_gemm.pack_onednn(torch.randn(1536, 576))
process = psutil.Process()
for rows in range(1, 9):  # the allocator's and oneDNN's first use, outside the measure
    cpu_gemm.onednn_linear(torch.randn(rows, 576), weight, None)
before = process.memory_info().rss
for rows in range(9, 409):
    cpu_gemm.onednn_linear(torch.randn(rows, 576), weight, None)
growth = (process.memory_info().rss - before) / 2**20
print(json.dumps({"growth_mib": growth, **{name: os.environ[name] for name in %r}}))
"""


def sweep(**env: str) -> dict:
    base = {key: value for key, value in os.environ.items() if key not in onednn_caches.VARIABLES}
    done = subprocess.run([sys.executable, "-c", SWEEP % (onednn_caches.VARIABLES,)], env={**base, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_sweep_of_row_counts_grows_a_process_boundedly():
    bounded = sweep()
    assert [bounded[name] for name in onednn_caches.VARIABLES] == [str(onednn_caches.CAPACITY)] * 2
    unbounded = sweep(**dict.fromkeys(onednn_caches.VARIABLES, "1024"))  # the caches' defaults
    assert unbounded["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"  # a value already set wins
    assert bounded["growth_mib"] < 250, bounded
    assert unbounded["growth_mib"] > 2 * bounded["growth_mib"], (bounded, unbounded)
