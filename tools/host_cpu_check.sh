#!/bin/bash
# The native CPU kernels on the lent GPU machine's host CPU (an Intel Xeon with AMX there, 16
# cores: a CPU no development machine has): build them, probe why a failed check crashed there
# (tools/native_throw_probe.py), run the CPU tests that use them (each file in a pytest of its
# own, so that a crash ends only that file), then `cpu_small_linear.py`, where
# the small-batch kernel wins against oneDNN at 1, 4 and 16 threads on SmolLM2's shapes (random
# weights made there). Logs and JSON under OUT (default ./host_cpu_out).
#
# Needs the wheels of tools/gpu_check.sh in .whl/, and SmolLM2's config and tokenizer in .whl/smol/:
#   mkdir -p .whl/smol && cp /work/smollm2-hf/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .whl/smol/
# Then, with the commit the files are (see tools/gpu_check.sh):
#   PAGEDSERVE_SOURCE="COMMIT TREE" bash tools/host_cpu_check.sh
set -u
OUT=${OUT:-host_cpu_out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source "$(dirname "$0")/device_env.sh"

{ lscpu | grep -E "Model name|^CPU\(s\)|Core|Socket|Flags" | cut -c1-400; g++ --version | head -1
  files_line
  time $PY -c 'from pagedserve.kernels import native_build; print("native built:", native_build.load())'; } 2>&1 | tee "$OUT/host.txt"

# Which build flag, if any, turns a failed check into a crash there (all variants, in parallel).
timeout "${PROBE_S:-120}" $PY tools/native_throw_probe.py --output "$OUT/throw_probe.json" 2>&1 | grep -E "^ *[a-z_0-9]+: " | tee "$OUT/throw_probe.txt"

# The files whose tests raise from a native op last: on that machine (torch 2.11.0+cu130, g++ 13.3)
# the first such test died of a segmentation fault (benchmarks/results/README.md).
for file in tests/workers/test_native_layers.py tests/workers/test_small_batch_choice.py tests/workers/test_cpu_binding.py \
    tests/workers/test_cpu_gemm.py tests/workers/test_native_fp32_gemm.py tests/workers/layers/test_norm.py \
    tests/e2e/test_hf_exactness.py tests/e2e/test_fast_attention_exactness.py tests/engine/core/test_core_proc.py \
    tests/kernels/test_cpu_native.py tests/kernels/test_cpu_lora.py tests/workers/test_grammar_mask.py; do
    echo "== $file"
    timeout "${FILE_S:-120}" $PY -m pytest -q -rfEs -p no:cacheprovider -k "not ray" --timeout 100 "$file" 2>&1 | tail -4
done 2>&1 | tee "$OUT/cpu_tests.log"

$PY - <<'PY'
import shutil, torch, transformers
config = transformers.AutoConfig.from_pretrained(".whl/smol")
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained("/tmp/smol")
for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
    shutil.copy(f".whl/smol/{name}", "/tmp/smol")
PY
timeout "${BENCH_S:-120}" $PY benchmarks/cpu_small_linear.py --model /tmp/smol --threads 1,4,16 --output "$OUT/cpu_small_linear.json" 2>&1 | tail -3
