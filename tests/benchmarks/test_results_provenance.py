"""Every measured result records where it came from: the commit (and whether the tree was dirty),
the machine's CPU and the command (benchmarks/common.py's write_report adds them). The files
measured before write_report recorded them are named here, frozen: they are historical, each
measured at the commit that added it (`git log --diff-filter=A -- FILE`), and no new file may join
the list."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
BEFORE_PROVENANCE = frozenset(
    {
        "avx2_emulated/bf16_native.json",
        "avx2_emulated/bf16_torch.json",
        "avx2_emulated/fp32_native.json",
        "avx2_emulated/fp32_torch.json",
        "compare_core_process_200.json",
        "compare_vllm_cpu_200.json",
        "compare_vllm_cpu_light.json",
        "compare_vllm_cpu_light_fp32.json",
        "compare_vllm_cpu_native.json",
        "compare_vllm_cpu_native_fp32.json",
        "compare_vllm_cpu_quick.json",
        "compare_vllm_cpu_quiet.json",
        "compare_vllm_cpu_quiet_53f1585.json",
        "compare_vllm_cpu_session5.json",
        "compare_vllm_cpu_session5_offline.json",
        "compare_vllm_cpu_session6_quick.json",
        "compare_vllm_cpu_smoke8.json",
        "core_proc_core1.json",
        "core_proc_core2.json",
        "core_proc_inproc1.json",
        "core_proc_offline.json",
        "core_proc_offline_1_thread.json",
        "cpu_forward_bf16.json",
        "cpu_forward_vs.json",
        "cpu_kernels.json",
        "cpu_kernels_native.json",
        "cpu_small_linear.json",
        "engine_step_cpu.json",
        "engine_step_cpu_decode_path.json",
        "engine_step_cpu_quiet.json",
        "executor_overhead_cpu.json",
        "fuzz_http_cpu.json",
        "prefix_routing_cpu.json",
        "serve_transport/handle_grpc_off.json",
        "serve_transport/handle_grpc_on.json",
        "serve_transport/seq_1_off.json",
        "serve_transport/seq_2_mode_without_grpc_and_caller_loop.json",
        "serve_transport/seq_3_mode_on.json",
        "serve_transport/seq_4_off.json",
        "serve_transport/seq_5_mode_without_grpc_and_caller_loop.json",
        "serve_transport/seq_6_mode_with_grpc_only.json",
        "serve_transport/seq_7_mode_with_caller_loop_only.json",
        "serve_transport/throughput_mode_off.json",
        "serve_transport/throughput_mode_on.json",
        "serving_cpu_demo.json",
        "soak_cpu.json",
        "throughput_cpu_128prompts.json",
        "throughput_cpu_256prompts.json",
    }
)


def test_every_result_since_provenance_records_its_commit_cpu_and_command():
    for path in sorted(RESULTS.rglob("*.json")):
        name = path.relative_to(RESULTS).as_posix()
        if name in BEFORE_PROVENANCE:
            continue
        report = json.loads(path.read_text())
        provenance = report.get("provenance") or {}
        cpu = (provenance.get("machine") or report.get("machine") or {}).get("cpu")
        assert provenance.get("commit") and provenance.get("command") and cpu, f"{name}: no commit, command or CPU recorded"


def test_the_historical_list_names_only_files_that_exist():
    assert all((RESULTS / name).exists() for name in BEFORE_PROVENANCE)
