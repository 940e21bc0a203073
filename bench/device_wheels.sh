#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels a lent GPU machine lacks, for bench/gpu_sides.sh to install there: its image
# has torch and Lightning but not MONAI, Hydra, OmegaConf, nibabel or antlr4 (Python 3.12, x86-64). Run it here, where
# pip can download; then call the device with carry [".whl"]. antlr4-python3-runtime has only an sdist: its wheel is
# built here (pure Python).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY=${PYTHON:-python3}
for pkg in monai==1.6.1 hydra-core==1.3.2 omegaconf==2.3.0 nibabel==5.4.2; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pkg"
done
"$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls .whl
