"""Bounds oneDNN's primitive caches in every process that imports pagedserve.

A packed linear layer (workers/layers/cpu_gemm.py) runs through a oneDNN primitive made for its
exact shapes, the row count included, and two caches keep every primitive made: oneDNN's own
(ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's in torch (LRU_CACHE_CAPACITY), 1024 entries each
by default; a primitive stays in memory while either holds it. A server's steps come in every row
count from one to its token budget, and each primitive holds 0.6-1.7 MB (SmolLM2's layers in
bf16 on a Zen 5, more with more rows). Unbounded, a sweep of 340 row counts over SmolLM2's four
layer shapes grew a process by 1.86 GB, and the soak test's server grew 279 MiB in its first 6 s
(float32); with both caches at CAPACITY entries the sweep's growth levels off at 90-180 MB, and a
two-minute soak of the demo server grew 27 MiB against 251 (benchmarks/results/onednn_caches_zen5/).
Offline bf16 took 26.8-27.0 s against 24.6-27.6 s at 1024 entries (four runs each, alternately;
SmolLM2, 256 prompts): within the runs' spread, at most 3% by the medians. A miss costs
0.3-1.4 ms per layer shape in bf16 (0.4-2.9 in float32), once per shape and step: the layers of
one shape share a primitive.

oneDNN and ideep read their capacity once, when the process first makes a primitive, so the
bound is set here, at pagedserve's import, before any model runs. A value already in the
environment wins.
"""

from __future__ import annotations

import os

CAPACITY = 64
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_caches() -> None:
    for name in VARIABLES:
        os.environ.setdefault(name, str(CAPACITY))
