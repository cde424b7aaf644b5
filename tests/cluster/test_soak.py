"""tools/soak.py for a few seconds against the tiny model on real Serve (so the script cannot
rot), and its verdict on runs that leaked. (Here rather than under tests/benchmarks/ because it
needs this folder's session Serve instance: Serve runs once per Ray cluster.)"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from pagedserve.cluster.server_config import ServerConfig
from tests.cluster.conftest import deploy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import soak  # noqa: E402

APP = "soak-test"


@pytest.fixture(scope="module")
def soak_url(serve_url, model_dirs):
    from ray import serve

    # A small cache, and no room reserved for outputs at admission, so the short run also preempts.
    engine = {"max_model_len": 256, "num_gpu_blocks_override": 24, "schedule_conservativeness": 0}
    deploy(ServerConfig(model=str(model_dirs["llama"]), served_model_name="soak-llama", engine=engine), APP, "/soak")
    yield serve_url + "/soak"
    serve.delete(APP)


def test_short_soak_passes(soak_url, tmp_path):
    output = tmp_path / "soak.json"
    # Samples every 0.5 s: each reads gauges the replica reports once a second. Two full suite runs
    # once read a peak KV usage of 0: AsyncLLM's idle snapshot hid the busy steps after it
    # (tests/engine/test_async_llm.py, the first busy step after an idle moment).
    argv = ["--url", soak_url, "--duration-s", "8", "--warmup-s", "0", "--sample-interval-s", "0.5", "--concurrency", "6"]
    assert soak.main([*argv, "--max-tokens", "24", "--seed", "3", "--output", str(output)]) == 0
    summary = json.loads(output.read_text())
    assert summary["passed"] and summary["failures"] == [] and summary["errors"] == {}
    assert summary["num_requests"] >= 10 and summary["outcomes"]["ok"] >= 1, summary["outcomes"]
    assert summary["kv_cache_usage_after"] == 0 and summary["peak_kv_cache_usage"] > 0
    assert {"llm_server", "ingress", "proxy"} <= set(summary["rss_mib_last"]), summary["rss_mib_last"]
    assert all(size > 0 for size in summary["rss_mib_last"].values())
    assert len(summary["samples"]) >= 3


def _args(**overrides):
    return soak.parse_args(["--warmup-s", "10", "--max-rss-growth-mib", "100", *[f"--{k}={v}" for k, v in overrides.items()]])


def _samples(kv_after: float, rss_end: float) -> list[dict]:
    sample = {"kv_cache_usage_perc": 0.5, "num_requests_running": 1, "num_requests_waiting": 0, "num_preemptions_total": 0}
    return [
        {**sample, "t_s": 0.0, "num_requests": 0, "rss_mib": {"llm_server": 100.0}},
        {**sample, "t_s": 10.0, "num_requests": 5, "rss_mib": {"llm_server": 500.0}},  # after warm-up
        {**sample, "t_s": 20.0, "num_requests": 9, "kv_cache_usage_perc": kv_after, "rss_mib": {"llm_server": rss_end}},
    ]


def test_verdict_fails_on_leaks_and_errors():
    outcomes = Counter({("stream", "ok"): 5, ("abort", "aborted"): 2, ("malformed", "rejected_400"): 1})
    idle = {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0, "num_requests_waiting": 0.0}
    # Growth is measured from the first sample after the warm-up: 500 -> 590 MiB is within 100.
    assert soak._summary(_args(), "m", outcomes, _samples(0.0, 590.0), idle, 200, 20.0)["passed"]
    stuck = {**idle, "kv_cache_usage_perc": 0.25}
    failures = soak._summary(_args(), "m", outcomes, _samples(0.25, 590.0), stuck, 200, 20.0)["failures"]
    assert len(failures) == 1 and "did not go idle" in failures[0]
    failures = soak._summary(_args(), "m", outcomes, _samples(0.0, 601.0), idle, 200, 20.0)["failures"]
    assert failures == ["llm_server RSS grew 101 MiB (bound 100 MiB)"]
    broken = outcomes + Counter({("stream", "stream_truncated"): 1, ("chat", "http_500"): 2})
    summary = soak._summary(_args(), "m", broken, _samples(0.0, 590.0), idle, 503, 20.0)
    assert summary["errors"] == {"stream:stream_truncated": 1, "chat:http_500": 2}
    assert not summary["passed"] and any("/health answered 503" in f for f in summary["failures"])
