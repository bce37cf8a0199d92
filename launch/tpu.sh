#!/usr/bin/env bash
# Cloud TPU pods for bov_jax: create, set up, run, sweep, watch, delete.
#
#   bash launch/tpu.sh create                        # queued resource (spot/reserved/on-demand)
#   bash launch/tpu.sh setup                         # copy this checkout's code, install the runtime set
#   bash launch/tpu.sh run --config=configs/bov_780m.py [--config.x=y ...]
#   bash launch/tpu.sh sweep --sweep=configs/sweeps/table2.py
#   bash launch/tpu.sh logs | ssh [COMMAND] | delete
#
# Settings (environment):
#   PROJECT, ZONE, TPU_NAME, ACCELERATOR_TYPE (e.g. v5p-64, v4-32)   required
#   WORKDIR            run directory, a gs:// bucket path on pods  (run, sweep)
#   RUNTIME_VERSION    TPU VM image       (default: tpu-ubuntu2204-base)
#   PROVISIONING       spot | reserved | on-demand                  (default: spot)
#   REMOTE_DIR         checkout location on the workers             (default: bov_jax)
#   DRY_RUN=1          print every gcloud command instead of running it
set -euo pipefail

RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
PROVISIONING="${PROVISIONING:-spot}"
REMOTE_DIR="${REMOTE_DIR:-bov_jax}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() { echo "launch/tpu.sh: $*" >&2; exit 2; }

need() {
  local name
  for name in "$@"; do
    if [ -z "${!name:-}" ]; then
      case "$name" in
        PROJECT) die "PROJECT is not set (the Google Cloud project id)";;
        ZONE) die "ZONE is not set (a TPU zone such as us-central2-b)";;
        TPU_NAME) die "TPU_NAME is not set (a name for the TPU VM)";;
        ACCELERATOR_TYPE) die "ACCELERATOR_TYPE is not set (such as v5p-64 or v4-32)";;
        WORKDIR) die "WORKDIR is not set (the run directory, e.g. gs://BUCKET/runs/NAME)";;
        *) die "$name is not set";;
      esac
    fi
  done
}

# Runs a command, or prints it (shell-quoted) when DRY_RUN=1.
run_cmd() {
  if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "$@"
    printf '\n'
  else
    "$@"
  fi
}

quote_args() {
  local out="" a
  for a in "$@"; do out+=" $(printf '%q' "$a")"; done
  printf '%s' "$out"
}

tpu_ssh() {  # tpu_ssh WORKER COMMAND
  run_cmd gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
    --worker="$1" --command="$2"
}

cmd_create() {
  need PROJECT ZONE TPU_NAME ACCELERATOR_TYPE
  local mode=()
  case "$PROVISIONING" in
    spot) mode=(--spot);;
    reserved) mode=(--reserved);;
    on-demand) mode=();;
    *) die "PROVISIONING=$PROVISIONING: expected spot, reserved or on-demand";;
  esac
  run_cmd gcloud compute tpus queued-resources create "${TPU_NAME}-qr" \
    --project="$PROJECT" --zone="$ZONE" --node-id="$TPU_NAME" \
    --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" "${mode[@]}"
}

cmd_setup() {
  need PROJECT ZONE TPU_NAME
  # The code only: no virtualenv, run directories, caches or git history.
  local tarball
  tarball="$(mktemp -t bov_jax_code.XXXXXX.tgz)"
  tar -czf "$tarball" -C "$HERE" --exclude=./.venv --exclude=./runs --exclude=./.git \
    --exclude='__pycache__' --exclude='*.egg-info' --exclude=./.pytest_cache .
  run_cmd gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:~/bov_jax_code.tgz" \
    --project="$PROJECT" --zone="$ZONE" --worker=all
  rm -f "$tarball"
  # The runtime set and TPU jax only (not the test tools).
  tpu_ssh all "mkdir -p ~/$REMOTE_DIR && tar -xzf ~/bov_jax_code.tgz -C ~/$REMOTE_DIR && cd ~/$REMOTE_DIR && python3 -m pip install -q '.[tpu]'"
}

main_command() {  # the training command line every worker runs
  printf 'cd ~/%s && python3 -m bov_jax.main --workdir=%q%s' "$REMOTE_DIR" "$WORKDIR" \
    "$(quote_args "$@")"
}

cmd_run() {
  need PROJECT ZONE TPU_NAME WORKDIR
  [ $# -gt 0 ] || die "run needs --config=FILE (and optional --config.* overrides)"
  # the log stays in the remote checkout (the command has cd'd there)
  tpu_ssh all "$(main_command "$@") > bov_jax_run.log 2>&1 &"
}

cmd_sweep() {
  need PROJECT ZONE TPU_NAME WORKDIR
  [ $# -gt 0 ] || die "sweep needs --sweep=FILE"
  local points line
  points="$(cd "$HERE" && python3 -m bov_jax.sweep "$@" --print --workdir_root="$WORKDIR")"
  # One run per sweep point, one after another on the whole pod.
  while IFS= read -r line; do
    [ -n "$line" ] || continue
    tpu_ssh all "cd ~/$REMOTE_DIR && ${line/python -m/python3 -m} >> bov_jax_sweep.log 2>&1"
  done <<< "$points"
}

cmd_logs() {
  need PROJECT ZONE TPU_NAME
  tpu_ssh 0 "tail -n 100 -f ~/$REMOTE_DIR/bov_jax_run.log"
}

cmd_ssh() {
  need PROJECT ZONE TPU_NAME
  if [ $# -gt 0 ]; then
    tpu_ssh "${WORKER:-0}" "$*"
  else
    run_cmd gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
      --worker="${WORKER:-0}"
  fi
}

cmd_delete() {
  need PROJECT ZONE TPU_NAME
  run_cmd gcloud compute tpus queued-resources delete "${TPU_NAME}-qr" \
    --project="$PROJECT" --zone="$ZONE" --force --quiet
}

usage() {
  sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

sub="${1:-}"
[ $# -gt 0 ] && shift
case "$sub" in
  create) cmd_create "$@";;
  setup) cmd_setup "$@";;
  run) cmd_run "$@";;
  sweep) cmd_sweep "$@";;
  logs) cmd_logs "$@";;
  ssh) cmd_ssh "$@";;
  delete) cmd_delete "$@";;
  -h|--help|help) usage;;
  "") usage; exit 2;;
  *) die "unknown subcommand '$sub' (create, setup, run, sweep, logs, ssh, delete)";;
esac
