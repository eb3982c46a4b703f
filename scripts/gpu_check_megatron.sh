#!/usr/bin/env bash
# The megatron backend for real on one CUDA GPU (H200 device machine): see scripts/gpu_check_megatron.py.
# That machine has Python 3.12 + CUDA torch + triton but no megatron-core and no omegaconf, and no
# network: the wheels travel in .whl/ (docs/megatron.md, "GPU check", lists the download commands).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 220 python3 scripts/gpu_check_megatron.py
