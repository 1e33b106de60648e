# Shared by the sbatch scripts: what a user edits, and the signal/requeue logic.
# Sourced by an sbatch script after it has found this repository (see the script's first lines).
#
# CLIPDIST_REPO   this repository on the host (found from the submitted script's path when unset)
# CLIPDIST_IMAGE  container image (enroot/pyxis); empty: run in the current Python environment
# CLIPDIST_APP    where train.py is inside the container (the Dockerfile puts it in /app)
# RUNS_DIR        host folder for run directories (default: runs/ in the folder you submitted from);
#                 mounted at the same path in the container
# DATA_DIR        host folder with your shards, mounted at the same path in the container
# RUN_NAME        run name (default slurm-<job id>: a requeued job resumes its own run)
# Rank, world size and the rendezvous (first node of the job, a port derived from the job id)
# come from srun's variables: clipdist.distributed.launch.detect_env. Intra-op threads per task come from
# --cpus-per-task (SLURM_CPUS_PER_TASK).
CLIPDIST_REPO=${CLIPDIST_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
CLIPDIST_IMAGE=${CLIPDIST_IMAGE:-}
CLIPDIST_APP=${CLIPDIST_APP:-/app}
RUNS_DIR=${RUNS_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/runs}
DATA_DIR=${DATA_DIR:-/data}
RUN_NAME=${RUN_NAME:-slurm-${SLURM_JOB_ID:-local}}

if [ -z "$CLIPDIST_IMAGE" ] && [ ! -f "$CLIPDIST_REPO/train.py" ]; then
  echo "clipdist: no train.py in CLIPDIST_REPO=$CLIPDIST_REPO; set CLIPDIST_REPO to the clipdist checkout" >&2
  exit 1
fi

# run_clipdist DEFAULT_WORLD [Hydra overrides...]: one srun task per device, USR1 → checkpoint → requeue.
run_clipdist() {
  local default_world=$1
  shift
  local overrides=("$@") arg
  for arg in "$@"; do
    [[ $arg == world=* ]] && default_world=""
  done
  [ -n "$default_world" ] && overrides=("world=$default_world" "${overrides[@]}")
  local train=(python "$CLIPDIST_REPO/train.py") container=()
  if [ -n "$CLIPDIST_IMAGE" ]; then
    container=(--container-image="$CLIPDIST_IMAGE" --container-mounts="$DATA_DIR:$DATA_DIR,$RUNS_DIR:$RUNS_DIR")
    train=(python "$CLIPDIST_APP/train.py")
  fi
  mkdir -p "$RUNS_DIR"
  echo "clipdist: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST: run $RUNS_DIR/$RUN_NAME"
  # --kill-on-bad-exit: a task that fails ends the others at once instead of leaving them waiting.
  srun "${container[@]}" --kill-on-bad-exit=1 \
    "${train[@]}" name="$RUN_NAME" run_dir="$RUNS_DIR/$RUN_NAME" resume=auto "${overrides[@]}" &
  local srun_pid=$!
  # srun forwards USR1 to every task; clipdist checkpoints and exits 0; then the job is requeued.
  trap 'echo "clipdist: USR1 (time limit near or preemption): asking for a checkpoint"; kill -USR1 "$srun_pid";
        wait "$srun_pid" || true; scontrol requeue "$SLURM_JOB_ID"; exit 0' USR1
  wait "$srun_pid"
}
