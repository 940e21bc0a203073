#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and install voxdiff into it.
#
#   scripts/setup_env.sh          # runtime only
#   scripts/setup_env.sh test     # with the test extras
#
# torch comes first and is chosen for the machine:
#   - a CUDA GPU is present (nvidia-smi lists one): the default torch==$TORCH_VERSION wheel from PyPI,
#     which is the CUDA build on Linux x86-64;
#   - no CUDA GPU: the CPU build, torch==$TORCH_VERSION+cpu, taken from pip's configured find-links/indexes
#     when one carries it (as on our CI machines), else from PyTorch's CPU wheel index.
# Override with VOXDIFF_TORCH_SPEC (e.g. "torch==2.13.0+cu128 --index-url ...") when a cluster needs another build.
# Idempotent: a stamp file records what was installed, so a second run costs a second.
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${1:-}"
TORCH_VERSION="${VOXDIFF_TORCH_VERSION:-2.13.0}"
VENV="${VOXDIFF_VENV:-.venv}"
PY="${PYTHON:-python3}"

stamp_key="torch=${TORCH_VERSION};extras=${EXTRAS};spec=${VOXDIFF_TORCH_SPEC:-};$(sha1sum pyproject.toml | cut -c1-12)"
if [[ -f "$VENV/.voxdiff-stamp" && "$(cat "$VENV/.voxdiff-stamp")" == "$stamp_key" ]]; then
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[setup] creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

have_torch=$("$VENV/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
if [[ -n "${VOXDIFF_TORCH_SPEC:-}" ]]; then
    echo "[setup] installing torch from VOXDIFF_TORCH_SPEC=$VOXDIFF_TORCH_SPEC"
    # shellcheck disable=SC2086
    pip_install $VOXDIFF_TORCH_SPEC
elif [[ "$have_torch" == "$TORCH_VERSION"* ]]; then
    echo "[setup] torch $have_torch already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "[setup] CUDA GPU found: installing the CUDA build of torch==$TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION"
else
    echo "[setup] no CUDA GPU: installing the CPU build of torch==$TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION+cpu" 2>/dev/null \
        || pip_install "torch==$TORCH_VERSION+cpu" --index-url https://download.pytorch.org/whl/cpu
fi

if [[ -n "$EXTRAS" ]]; then
    echo "[setup] installing voxdiff[$EXTRAS]"
    pip_install -e ".[$EXTRAS]"
else
    echo "[setup] installing voxdiff"
    pip_install -e .
fi
echo "$stamp_key" > "$VENV/.voxdiff-stamp"
