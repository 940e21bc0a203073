# Shared body of every slurm/*.slurm job (sourced, not run): environment, preflight, then srun train.py.
#
# Inputs: VOXDIFF_EXPERIMENT (set by the job script), the job's arguments (extra Hydra overrides), and
# VOXDIFF_OVERRIDES (more overrides through the environment, e.g. CPU-sized ones in tests:
#   VOXDIFF_OVERRIDES="trainer=cpu data.volume_shape=[32,32,32]" sbatch slurm/exp11.slurm).
# The run directory is fixed per job ($VOXDIFF_RUN_ROOT/<experiment>/job-<SLURM_JOB_ID>), so a requeued job
# finds its checkpoints there and resumes (ckpt_path=auto: the newer of the preemption checkpoint and last.ckpt).
cd "$SLURM_SUBMIT_DIR"
set -a
# shellcheck disable=SC1091
source slurm/site.env
set +a
# an empty site value means "not set": leave the library's default rather than an empty string
for var in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_DISABLE NCCL_DEBUG; do
    [[ -n "${!var:-}" ]] || unset "$var"
done
[[ -n "${VOXDIFF_MODULES:-}" ]] && eval "$VOXDIFF_MODULES"
if [[ -f "$VOXDIFF_VENV/bin/activate" ]]; then
    # shellcheck disable=SC1091
    source "$VOXDIFF_VENV/bin/activate"
else
    echo "[voxdiff] no Python environment at VOXDIFF_VENV=$VOXDIFF_VENV (slurm/site.env); run scripts/setup_env.sh" >&2
    exit 2  # EXIT_CONFIG (no Python yet to read the table below)
fi
# The exit codes of every voxdiff command, from their one table (voxdiff/cli/exit_codes.py; README "Errors and
# exit codes"): EXIT_OK, EXIT_CONFIG, EXIT_NONFINITE, EXIT_NO_FIT, EXIT_DATA, EXIT_WRITE, EXIT_MEMORY,
# EXIT_TERMINATED.
eval "$(python -m voxdiff.cli.exit_codes)"

RUN_DIR="$VOXDIFF_RUN_ROOT/$VOXDIFF_EXPERIMENT/job-$SLURM_JOB_ID"
OVERRIDES=("experiment=$VOXDIFF_EXPERIMENT" "paths.run_dir=$RUN_DIR")
# more than one GPU in the allocation: DDP, one process per GPU (devices and nodes come from Slurm's environment)
if (( ${SLURM_NNODES:-1} * ${SLURM_NTASKS_PER_NODE:-1} > 1 )); then
    OVERRIDES+=("trainer=ddp")
fi
# the site's GPU type (slurm/site.env): preflight.py and train.py's own verdict predict for it; ++ sets the key in
# both configs (train.py's has no preflight block)
if [[ -n "${GPU_TYPE:-}" ]]; then
    OVERRIDES+=("++preflight.gpu=$GPU_TYPE")
fi
# shellcheck disable=SC2206
OVERRIDES+=(${VOXDIFF_OVERRIDES:-} "$@")
echo "[voxdiff] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $(hostname): ${OVERRIDES[*]}"

# Fail in seconds, with the preflight's message, if the config is invalid (EXIT_CONFIG) or does not fit the
# allocated GPU (EXIT_NO_FIT); the job exits with the preflight's own code. A requeued start (the same job, config
# and GPU type) skips it: it passed at the first start, and train.py checks the config, the fit and the disk again
# before it trains.
rc=$EXIT_OK
if (( ${SLURM_RESTART_COUNT:-0} > 0 )); then
    echo "[voxdiff] restart ${SLURM_RESTART_COUNT}: the preflight passed at the first start (train.py checks again)"
else
    python preflight.py "${OVERRIDES[@]}" || rc=$?
fi
if (( rc != EXIT_OK )); then
    why=$(python -m voxdiff.cli.exit_codes --describe "$rc")
    echo "[voxdiff] preflight refused experiment=$VOXDIFF_EXPERIMENT (exit $rc: $why); nothing was trained" >&2
    exit "$rc"
fi

# srun forwards SIGUSR1 (--signal) to train.py: Lightning's SLURM environment saves hpc_ckpt_N.ckpt and runs
# `scontrol requeue`. A SIGTERM without it (a preemption's grace period, scancel --signal=TERM) saves
# checkpoints/last.ckpt and requeues the job while Slurm still reports it RUNNING; after scancel the checkpoint is
# saved and the job stays cancelled (train.py exits EXIT_TERMINATED). The requeued job re-enters here with the
# same job id and run directory, and ckpt_path=auto resumes from the newest checkpoint.
srun --kill-on-bad-exit=1 python train.py "${OVERRIDES[@]}" ckpt_path=auto
