# Shared by the sbatch scripts: what a user edits, and the signal/requeue logic.
#
# CLIPDIST_IMAGE  container image (enroot/pyxis); empty: run in the current Python environment
# CLIPDIST_REPO   where train.py is (inside the container: /app)
# DATA_DIR        mounted into the container at the same path
CLIPDIST_IMAGE=${CLIPDIST_IMAGE:-}
CLIPDIST_REPO=${CLIPDIST_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
DATA_DIR=${DATA_DIR:-/data}
# One run directory per job: a requeued job (same SLURM_JOB_ID) resumes from its newest checkpoint.
RUN_NAME=${RUN_NAME:-slurm-${SLURM_JOB_ID:-local}}

export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n 1 || echo localhost)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}

run_clipdist() {
  local container=()
  if [ -n "$CLIPDIST_IMAGE" ]; then
    container=(--container-image="$CLIPDIST_IMAGE" --container-mounts="$DATA_DIR:$DATA_DIR,$CLIPDIST_REPO/runs:/app/runs")
  fi
  # srun forwards USR1 to every task; clipdist checkpoints and exits 0; then we requeue.
  srun "${container[@]}" --kill-on-bad-exit=1 \
    python "$CLIPDIST_REPO/train.py" name="$RUN_NAME" resume=auto "$@" &
  local srun_pid=$!
  trap 'echo "time limit near: asking for a checkpoint"; kill -USR1 "$srun_pid"; wait "$srun_pid" || true;
        scontrol requeue "$SLURM_JOB_ID"; exit 0' USR1
  wait "$srun_pid"
}
