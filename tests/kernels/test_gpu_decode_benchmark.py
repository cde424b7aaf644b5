"""benchmarks/gpu_decode.py: its arguments, its device table, and a toy run of every part on the CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_decode.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("gpu_decode", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments_and_roofline():
    bench = load_benchmark()
    args = bench.parse_args(["--batch-sizes", "1,8", "--backends", "triton,flash_attn", "--bandwidth-gbs", "3350"])
    assert args.batch_sizes == [1, 8] and args.bandwidth_gbs == 3350
    assert bench.engine_kwargs("flash_attn", args) == {"attention_backend": "flash_attn", "enforce_eager": False, "block_size": 256}
    assert bench.engine_kwargs("triton-eager", args)["enforce_eager"] is True
    assert bench.engine_kwargs("triton-unfused", args) == bench.engine_kwargs("triton", args)
    # 2.47 GB of weights + 0.53 GB of KV at 3.35 TB/s: about 0.9 ms per step at best.
    row = bench._roofline_row("triton", 32, 1.8, 2_471_000_000, 530_000_000, 3350)
    assert row["roofline_ms"] == round(3.001e9 / 3.35e12 * 1e3, 3) and row["roofline_fraction"] == 0.498


def test_dry_run_on_cpu(tmp_path):
    bench = load_benchmark()
    output = tmp_path / "result.json"
    result = bench.main(["--dry-run", "--profile-steps", "2", "--output", str(output)])
    assert json.loads(output.read_text()) == result
    assert result["device"] == "cpu"
    assert [row["batch"] for row in result["decode"]] == [1, 4]
    assert all(row["step_ms"] > 0 for row in result["decode"])
    # The profiled steps are the engine's: its step function is among the top rows, once a step.
    profile = result["decode"][0]["host_profile"]
    step = next(r for r in profile["by_cumulative"] if r["function"].startswith("llm_engine.py:")
                and r["function"].endswith("(step)"))
    assert step["calls_per_step"] == 1.0 and step["cum_ms"] > 0
    assert not any(r["function"].startswith("gpu_decode.py") for r in profile["by_cumulative"])
    assert result["throughput"]["pagedserve_output_tokens_per_s"] > 0
    assert {row["batch"] for row in result["kernels"]} == {"decode_b1", "decode_b4", "prefill_2x8"}
