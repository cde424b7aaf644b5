"""compare_vllm.py --interleave: both servers up at once, the engines taking turns at each load
point in ABBA order, each turn with prompts of its own (the same for both engines), and each
figure the median over an engine's turns, with each round's ratio beside it. The servers and the
load client are fakes here (a fake client whose speed drifts run by run, as this VM's does); the
CPU accounting around the client is the real one."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import compare_vllm  # noqa: E402
from tests.benchmarks.test_compare_vllm_env import parsed  # noqa: E402


def test_interleave_needs_two_rounds_and_two_online_engines(capsys):
    assert parsed("--interleave", "3").interleave == 3
    assert parsed().interleave == 0
    for extra in (("--interleave", "1"), ("--interleave", "-2"), ("--interleave", "4", "--engines", "pagedserve,pagedserve-compiled")):
        with pytest.raises(SystemExit):
            parsed(*extra)
        assert "two or more rounds, and two online engines" in capsys.readouterr().err


def test_the_engines_take_turns_and_each_figure_is_the_median_of_its_turns(tmp_path, monkeypatch):
    calls: list[tuple[str, str]] = []  # (engine, seed) in the order the client ran
    started: list[str] = []
    # The machine slows run by run; pagedserve's TTFT is 0.8x vLLM's at any one moment.
    ttft_at_speed = {"pagedserve": 80.0, "vllm": 100.0}

    @contextlib.contextmanager
    def fake_server(engine, python, args, env, timeout_s=900):
        started.append(engine)
        assert started == ["pagedserve", "vllm"][: len(started)]
        yield compare_vllm.Server(engine, f"http://{engine}", "m", 0)
        started.remove(engine)  # stopped only after every turn ran
        assert len(calls) == 2 * 3 * 2

    def fake_client(command, server_pid, timeout, **_):
        engine = command[command.index("--base-url") + 1].removeprefix("http://")
        calls.append((engine, command[command.index("--seed") + 1]))
        slowdown = 1 + 0.1 * len(calls)
        result = {"completed": int(command[command.index("--num-prompts") + 1]), "duration": 10.0 * slowdown}
        result |= {"output_throughput": 1000 / ttft_at_speed[engine] / slowdown, "request_throughput": 1.0, "median_itl_ms": 5.0 * slowdown}
        result |= {"median_ttft_ms": ttft_at_speed[engine] * slowdown, "p99_ttft_ms": None}
        (tmp_path / command[command.index("--result-filename") + 1]).write_text(json.dumps(result))
        watch = compare_vllm.machine_noise.CpuWatch(server_pid)
        return subprocess.CompletedProcess(command, 0, "", ""), watch.finish()

    monkeypatch.setattr(compare_vllm, "start_server", fake_server)
    monkeypatch.setattr(compare_vllm, "engine_python", lambda engine, args: sys.executable)
    monkeypatch.setattr(compare_vllm.machine_noise, "run_watched", fake_client)
    monkeypatch.setattr(compare_vllm.machine_noise, "speed_probe", lambda: 100.0)
    args = parsed("--max-concurrency", "1,4", "--interleave", "3", "--num-prompts", "16")
    noise: dict = {}
    online = compare_vllm.run_online_interleaved(["pagedserve", "vllm"], args, tmp_path, noise)

    engines = [engine for engine, _ in calls]
    assert engines == ["pagedserve", "vllm", "vllm", "pagedserve", "pagedserve", "vllm"] * 2  # ABBA.. at each point
    seeds = {engine: [seed for e, seed in calls if e == engine] for engine in ("pagedserve", "vllm")}
    assert seeds["pagedserve"] == seeds["vllm"] and len(set(seeds["vllm"])) == 6  # a turn's prompts: its own, both engines'
    assert list(noise["pagedserve"]["points"]) == [f"c{level} round {turn}" for level in (1, 4) for turn in range(3)]
    assert noise["vllm"]["speed_probe_gflops"] == [100.0, 100.0]

    ours, theirs = online["pagedserve"]["c1"], online["vllm"]["c1"]
    assert len(ours["turns"]) == 3 and ours["completed"] == 48
    assert ours["median_ttft_ms"] == 80.0 * 1.4 and theirs["median_ttft_ms"] == 100.0 * 1.3  # the middle turn of each
    assert ours["p99_ttft_ms"] is None
    report = {"online": online}
    by_round = compare_vllm.ratios(report)["concurrency_1"]["by_round"]["median_ttft_ms"]
    # Side by side a turn apart, each round's ratio stays near the true 0.8 while the machine slows 10% a run.
    assert by_round == [round(0.8 * 1.1 / 1.2, 3), round(0.8 * 1.4 / 1.3, 3), round(0.8 * 1.5 / 1.6, 3)]
    compare_vllm.machine_noise.summarize({"online": noise})  # the accounting's shape is what summarize reads
