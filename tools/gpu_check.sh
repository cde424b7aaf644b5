#!/bin/bash
# The GPU checks, in one go, for a machine with a CUDA device and no Ray: the engine runs in
# process there. Writes each part's log (and the benchmark's JSON) under OUT (default ./gpu_out).
#
#   bash tools/gpu_check.sh            # every part
#   PARTS="gpu bench" bash tools/gpu_check.sh
#
# Parts, in order of what matters most when time is short:
#   gpu    the `gpu`-marked tests (Triton at serving sizes, CUDA graphs, GPU memory and dtype)
#   bench  benchmarks/gpu_decode.py (decode step against the HBM roofline, offline against HF)
#   wide   the CPU-capable kernel and engine tests, run on the GPU: Triton kernels, the offline
#          API and LoRA against Hugging Face and PEFT
# The native CPU kernels are not built (PAGEDSERVE_NATIVE_KERNELS=0): nothing here runs them.
set -u
OUT=${OUT:-gpu_out}
PARTS=${PARTS:-gpu bench wide}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PAGEDSERVE_NATIVE_KERNELS=0 PYTHONUNBUFFERED=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
PY=${PYTHON:-python3}

{ nvidia-smi -L; $PY -c "import torch, triton, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/device.txt"

run_tests() {  # name, timeout, pytest args...
    local name=$1 limit=$2; shift 2
    timeout "$limit" $PY -m pytest -q -rs -p no:cacheprovider --timeout 150 --durations=15 \
        --junitxml="$OUT/$name.xml" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40
}

for part in $PARTS; do
    case $part in
        gpu) run_tests gpu "${GPU_TESTS_S:-240}" -m gpu tests/kernels tests/workers/test_cuda_graphs.py ;;
        bench) timeout "${BENCH_S:-240}" $PY benchmarks/gpu_decode.py --backends triton,triton-eager --decode-steps 30 \
                   --output "$OUT/gpu_decode.json" 2>&1 | tee "$OUT/bench.log" | tail -60 ;;
        wide) run_tests wide "${WIDE_TESTS_S:-200}" -m "not gpu" tests/kernels/test_triton_attention.py \
                  tests/kernels/test_triton_e2e.py tests/engine/test_llm_api.py \
                  tests/lora/test_lora_exactness.py tests/lora/test_adapter_tiers.py ;;
        *) echo "unknown part $part (gpu, bench, wide)"; exit 2 ;;
    esac
done
