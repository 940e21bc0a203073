#!/usr/bin/env bash
# Run bench_gpu_step.py sides on a lent GPU machine in one call, from a plan, keeping every side's result as it ends.
#
#   bash bench/gpu_sides.sh PLAN [OUT]      # OUT defaults to $OUT (the device tool's folder), else ./gpu_sides_out
#
# PLAN has one line per side: `TAG SIDE EXPERIMENT WARMUP STEPS [override ...]` (SIDE: plain, compiled, voxdiff,
# auto; see bench/bench_gpu_step.py; `voxdiff+profile` or `auto+profile` records the steady steps with torch.profiler
# and appends its tables of operators to OUT/results.txt, each line prefixed `TAG | `: time such a side again unprofiled;
# `voxdiff+history` or `auto+history` records the allocator's history over the warm-up steps and appends which
# allocations reserved segments in which pool the same way: its steady steps are timed as usual).
# A line starting with `&` runs in the background (compile warm-ups in parallel,
# sharing one inductor cache: their times are not comparable); a line `wait` waits for them; a line starting with `!`
# is a shell command, its output appended to OUT/results.txt (e.g. `!python3 bench/measure_sampling.py ...`; `&!` in
# the background); other lines run one after the other, alone on the GPU (their times are). `#` starts a comment. Each side's JSON result is appended to
# OUT/results.txt as `TAG rc=.. wall=..s EXPERIMENT SIDE overrides :: {...}`, a failed side's stderr tail to
# OUT/errors.txt. `python bench/bench_gpu_step.py --rows-from` turns such lines (renamed `NAME SIDE: {...}`) into rows.
#
# Where the machine lacks a package voxdiff needs (its image has torch and Lightning, not MONAI or Hydra), wheels in
# .whl/ are installed to /tmp/site first (see the device tool's README); voxdiff runs from src/.
set -u
PLAN=$(realpath "$1")
OUTDIR=${2:-${OUT:-gpu_sides_out}}
mkdir -p "$OUTDIR" /tmp/gpu_sides
OUTDIR=$(realpath "$OUTDIR")
export OUT=$OUTDIR  # a plan's `!` lines write their files under $OUT, as on the device machine
cd "$(dirname "$0")/.." || exit 3  # the repository: bench/, src/, .whl/
T0=$(date +%s)
if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_sides: installing .whl/ failed" >&2; exit 3; }
  export PYTHONPATH=/tmp/site:$PWD/src
fi
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch, monai, lightning; print('torch', torch.__version__, 'monai', monai.__version__, 'lightning', lightning.__version__)"
} | tee -a "$OUTDIR/results.txt"

side() {  # TAG SIDE EXPERIMENT WARMUP STEPS [override ...]
  local tag=$1 kind=$2 name=$3 wu=$4 st=$5; shift 5
  local ov t1 rc prof=false hist=false
  if [[ $kind == *+profile ]]; then prof=true; kind=${kind%+profile}; fi
  if [[ $kind == *+history ]]; then hist=true; kind=${kind%+history}; fi
  ov=$(python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@")
  t1=$(date +%s)
  python3 bench/bench_gpu_step.py --worker \
    "{\"side\": \"$kind\", \"name\": \"$name\", \"overrides\": $ov, \"warmup\": $wu, \"steps\": $st, \"profile\": $prof, \"history\": $hist}" \
    > "/tmp/gpu_sides/$tag.out" 2> "/tmp/gpu_sides/$tag.err"
  rc=$?
  echo "$tag rc=$rc wall=$(( $(date +%s) - t1 ))s $name $kind $* :: $(grep '^{' "/tmp/gpu_sides/$tag.out" | tail -1)" \
    | tee -a "$OUTDIR/results.txt"
  if [[ $prof == true || $hist == true ]]; then grep -v '^{' "/tmp/gpu_sides/$tag.out" | sed "s/^/$tag | /" >> "$OUTDIR/results.txt"; fi
  grep -h "data.batch_size=auto" "/tmp/gpu_sides/$tag.out" >> "$OUTDIR/results.txt"
  if [[ $rc != 0 ]]; then { echo "== $tag"; tail -40 "/tmp/gpu_sides/$tag.err"; } >> "$OUTDIR/errors.txt"; fi
}

shell() {  # a plan's `!` line: its output to results.txt, its stderr to errors.txt where it failed
  local log
  log=$(mktemp)
  if ! bash -c "$1" > "$log.out" 2> "$log"; then { echo "== !$1"; tail -40 "$log"; } >> "$OUTDIR/errors.txt"; fi
  cat "$log.out" >> "$OUTDIR/results.txt"
  rm -f "$log" "$log.out"
}

while read -r line; do
  line=${line%%#*}
  [[ -z "${line// }" ]] && continue
  echo "[t=$(( $(date +%s) - T0 ))s] $line" | tee -a "$OUTDIR/results.txt"
  if [[ $line == wait ]]; then
    wait
  elif [[ $line == \!* ]]; then
    shell "${line#!}"
  elif [[ $line == \&\!* ]]; then
    shell "${line#&!}" &
  elif [[ $line == \&* ]]; then
    # shellcheck disable=SC2086
    side ${line#&} &
  else
    # shellcheck disable=SC2086
    side $line
  fi
done < "$PLAN"
wait
echo "[t=$(( $(date +%s) - T0 ))s] done" | tee -a "$OUTDIR/results.txt"
