#!/usr/bin/env bash
# The serving path on a CUDA GPU in one go: kernel tests on the device, greedy equivalence with
# transformers, the W4A16 GEMV and fused MoE against bf16, and the engine's decode tokens/s,
# bf16 against FP4; one markdown table on stdout (see loadtests/gpu_check.py). Exit status 0
# when every target is met, 1 when one is missed or a check broke, 2 without a CUDA GPU.
#
#   loadtests/gpu_check.sh [--layers 16] [--peak-gbs GB/s]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing was run" >&2
    exit 2
fi
# The repository root on the path: the equivalence check reuses the tests' oracle prompts.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" loadtests/gpu_check.py "$@"
