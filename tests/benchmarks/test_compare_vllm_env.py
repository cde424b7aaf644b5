"""compare_vllm.py's process environments: `--vllm-env` reaches vLLM's engine and nothing else,
`--pagedserve-env` pagedserve's, and pagedserve keeps the PYTHONPATH that points it at the tree
being measured."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import compare_vllm  # noqa: E402


def parsed(*extra: str):
    sys_argv, sys.argv = sys.argv, ["compare_vllm.py", "--model", "M", *extra]
    try:
        return compare_vllm.parse_args()
    finally:
        sys.argv = sys_argv


def test_vllm_env_reaches_the_vllm_engine_only(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tree/under/test")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    args = parsed("--vllm-env", "VLLM_CPU_NUM_OF_RESERVED_CPU=0", "--vllm-env", "LD_PRELOAD=/a.so:/b.so", "--kv-cache-gib", "2")

    vllm = compare_vllm.engine_env("vllm", args)
    assert vllm["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and vllm["LD_PRELOAD"] == "/a.so:/b.so"
    assert vllm["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "PYTHONPATH" not in vllm and "RAY_ADDRESS" not in vllm

    ours = compare_vllm.engine_env("pagedserve", args)
    assert ours["PYTHONPATH"] == "/tree/under/test"  # the worktree being measured, not the installed package
    assert "RAY_ADDRESS" not in ours  # `pagedserve serve` starts its own local Ray
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in ours and "LD_PRELOAD" not in ours

    client = compare_vllm.client_env()
    assert "LD_PRELOAD" not in client and "PYTHONPATH" not in client


def test_pagedserve_env_reaches_pagedserve_only(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    args = parsed("--pagedserve-env", "LD_PRELOAD=/t.so", "--vllm-env", "VLLM_CPU_NUM_OF_RESERVED_CPU=0")
    assert compare_vllm.engine_env("pagedserve", args)["LD_PRELOAD"] == "/t.so"
    assert "LD_PRELOAD" not in compare_vllm.engine_env("vllm", args)
    assert "LD_PRELOAD" not in compare_vllm.client_env()


def test_a_value_without_a_key_is_refused():
    assert compare_vllm.env_pairs(["A=1", "B=x=y"], "--vllm-env") == {"A": "1", "B": "x=y"}
    for flag in ("--vllm-env", "--pagedserve-env"):
        for bad in ("LD_PRELOAD", "=1"):
            with pytest.raises(SystemExit, match=f"{flag} '{bad}': expected KEY=VALUE"):
                compare_vllm.env_pairs([bad], flag)
