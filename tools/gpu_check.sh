#!/bin/bash
# The GPU checks, in one go, for a machine with a CUDA device and no Ray: the engine runs in
# process there. Writes each part's log (and the benchmark's JSON) under OUT (default ./gpu_out):
# five files in all.
#
#   bash tools/gpu_check.sh            # every part
#   PARTS="gpu bench" bash tools/gpu_check.sh
#
# Parts, in order of what matters most when time is short:
#   gpu    the `gpu`-marked tests (Triton at serving sizes, CUDA graphs, GPU memory and dtype)
#   wide   the engine's CPU-capable tests, run on the GPU (Triton attention, CUDA graphs, bf16
#          by default): float32 greedy against Hugging Face in every scheduling configuration,
#          the offline API, grammars against the grammar library's matcher, LoRA against PEFT
#   bench  benchmarks/gpu_decode.py (decode step against the HBM roofline, where a step's host
#          time goes, offline against HF)
# The native CPU kernels are not built (PAGEDSERVE_NATIVE_KERNELS=0): nothing here runs them.
#
# On the lent GPU machine the files arrive over a clone of the last landed commit, not of the one
# they are, so a result written there reads as that older commit, dirty. Name the commit they are:
#   PAGEDSERVE_SOURCE="COMMIT TREE" bash tools/gpu_check.sh   # here: git rev-parse HEAD HEAD^{tree}
# and the benchmark records COMMIT, clean, if the files there are exactly TREE
# (benchmarks/common.py, commit_info); otherwise what git says there.
#
# Packages a GPU image may lack travel as wheels in .whl/ (git-ignored) and are installed under
# /tmp/site first. For a Python 3.12 image without them, fetched where pip works:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
#       -d .whl pydantic pydantic_core annotated_types typing_inspection typing_extensions \
#       xgrammar apache-tvm-ffi llguidance jsonschema jsonschema_specifications referencing rpds_py
# (pin each to the version the venv has: `pip list`).
set -u
OUT=${OUT:-gpu_out}
PARTS=${PARTS:-gpu wide bench}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PAGEDSERVE_NATIVE_KERNELS=0 PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_env.sh"

{ files_line; nvidia-smi -L; $PY -c "import torch, triton, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/device.txt"

run_tests() {  # name, timeout, pytest args...
    local name=$1 limit=$2; shift 2
    timeout "$limit" $PY -m pytest -q -rfEs -p no:cacheprovider --timeout 120 --durations=15 "$@" 2>&1 \
        | tee "$OUT/$name.log" | tail -40
}

# What has not yet passed on a GPU first (benchmarks/results/README.md says which), so that a part
# cut short by its limit still answers that.
WIDE_TESTS=(
    tests/kernels/test_triton_layers.py tests/engine/test_llm_api.py
    tests/lora/test_lora_exactness.py tests/lora/test_adapter_tiers.py tests/lora/test_adapter_reads.py
    tests/engine/structured_outputs/test_grammar_exactness.py tests/engine/structured_outputs/test_offline_api.py
    tests/engine/structured_outputs/test_batched_bitmask.py
    tests/workers/test_sampler.py tests/workers/test_grammar_mask.py tests/workers/test_logit_bias.py
    tests/e2e/test_hf_exactness.py tests/kernels/test_triton_attention.py tests/kernels/test_triton_e2e.py
)

for part in $PARTS; do
    case $part in
        gpu) run_tests gpu "${GPU_TESTS_S:-180}" -m gpu tests/kernels tests/workers/test_cuda_graphs.py ;;
        wide) run_tests wide "${WIDE_TESTS_S:-260}" -m "not gpu" -k "not ray and not native" "${WIDE_TESTS[@]}" ;;
        bench) timeout "${BENCH_S:-150}" $PY benchmarks/gpu_decode.py --backends triton,triton-unfused,triton-eager --decode-steps 30 \
                   --profile-steps 20 --output "$OUT/gpu_decode.json" 2>&1 | tee "$OUT/bench.log" | tail -30 ;;
        *) echo "unknown part $part (gpu, wide, bench)"; exit 2 ;;
    esac
done
