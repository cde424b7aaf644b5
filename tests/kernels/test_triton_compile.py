"""The kernels compile for real GPUs (sm_80, sm_90), not only run in the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the test extra has it on x86-64 Linux only)")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's CUDA toolchain ships for Linux")
def test_kernels_compile_for_nvidia_gpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh cache: really compile
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_for_gpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("compiled") == 9
