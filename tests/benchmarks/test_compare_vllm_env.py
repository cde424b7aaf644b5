"""compare_vllm.py's process environments: `--vllm-env` reaches vLLM's engine and nothing else,
`--pagedserve-env` pagedserve's, and pagedserve keeps the PYTHONPATH that points it at the tree
being measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import compare_vllm  # noqa: E402

QUIET = {"wall_s": 1.0, "server_cpu_s": 0.0, "client_cpu_s": 0.0, "harness_cpu_s": 0.0, "others_cpu_s": 0.0, "steal_s": 0.0, "disturbed": False}


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


def test_each_load_point_gets_its_own_prompts_and_both_servers_the_same(tmp_path, monkeypatch):
    """A server keeps its prefix cache from one load point to the next: a seed repeated across
    points would find every later point's prompts already cached."""
    seen: dict[str, list[str]] = {}

    def fake_run(command, **_):
        seeds = seen.setdefault(command[command.index("--base-url") + 1], [])
        seeds.append(command[command.index("--seed") + 1])
        result = {key: 1.0 for key in ("duration", "request_throughput", "output_throughput", "median_ttft_ms", "median_itl_ms")}
        result["completed"] = int(command[command.index("--num-prompts") + 1])
        (tmp_path / command[command.index("--result-filename") + 1]).write_text(json.dumps(result))
        return subprocess.CompletedProcess(command, 0, "", "")

    def watched(command, server_pid, timeout, **_):  # the real accounting around the fake client
        watch = compare_vllm.machine_noise.CpuWatch(server_pid)
        return fake_run(command), watch.finish()

    monkeypatch.setattr(compare_vllm.machine_noise, "run_watched", watched)
    for extra in (("--request-rates", "inf,4,1"), ("--max-concurrency", "1,4,16,64")):
        seen.clear()
        args = parsed(*extra)
        for engine in ("pagedserve", "vllm"):
            server, noise = compare_vllm.Server(engine, f"http://{engine}", "m"), {}
            for point in compare_vllm.load_points(args):
                compare_vllm.bench_serve(server, point, args, tmp_path, noise)
            assert list(noise) == compare_vllm.load_points(args)  # each point's CPU accounting
            assert all(set(point) >= {"wall_s", "others_cpu_s", "steal_s", "disturbed"} for point in noise.values())
        ours, theirs = seen["http://pagedserve"], seen["http://vllm"]
        assert ours == theirs and len(set(ours)) == len(ours) == len(compare_vllm.load_points(args))


def test_an_online_workload_past_the_context_is_refused_before_any_server_starts(capsys):
    with pytest.raises(SystemExit):
        parsed("--online-input-len", "1024", "--online-output-len", "128")  # the default context is 1024
    assert "needs 1152 tokens of context" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parsed("--online-input-len", "1024", "--online-prefix-len", "1024", "--max-model-len", "4096", "--server-defaults")
    assert "more than the 2048 of vLLM's context" in capsys.readouterr().err
    assert parsed("--online-input-len", "1024", "--online-output-len", "128", "--max-model-len", "2048").max_model_len == 2048
    assert parsed("--online-input-len", "1024", "--online-output-len", "128", "--skip-online").skip_online


def test_a_load_point_with_failed_requests_reports_no_figure(tmp_path, monkeypatch):
    def fake_run(command, **_):
        result = {"completed": 0, "output_throughput": 0.0, "errors": ["", "HTTP 400: prompt too long"]}
        (tmp_path / command[command.index("--result-filename") + 1]).write_text(json.dumps(result))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(compare_vllm.machine_noise, "run_watched", lambda command, *_, **__: (fake_run(command), QUIET))
    with pytest.raises(RuntimeError, match=r"vllm completed 0 of 200 requests at inf: \['HTTP 400: prompt too long'\]"):
        compare_vllm.bench_serve(compare_vllm.Server("vllm", "http://vllm", "m"), "inf", parsed(), tmp_path, {})
