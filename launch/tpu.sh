#!/usr/bin/env bash
# Cloud TPU pods for bov_jax: create, set up, run, watch, sweep, delete.
#
#   bash launch/tpu.sh create [--config=FILE ...]    # queued resource (spot/reserved/on-demand)
#   bash launch/tpu.sh setup                         # copy this checkout's code, install the runtime set
#   bash launch/tpu.sh run --config=configs/bov_780m.py [--config.x=y ...]   # start it, detached
#   bash launch/tpu.sh watch --config=configs/bov_780m.py [--config.x=y ...] # keep it going
#   bash launch/tpu.sh sweep --sweep=configs/sweeps/table2.py               # detached, in turn
#   bash launch/tpu.sh logs | ssh [COMMAND] | delete
#
# SLICES=N (N > 1): N slices of ACCELERATOR_TYPE in one queued resource (multi-slice,
# over the data-center network): created with --node-count, nodes TPU_NAME-0 ... -N-1;
# setup and run reach every host of every slice, and each run gets
# --config.mesh.slices=N (the compile check, too: it compiles for all N slices). JAX
# finds the other slices itself (the MEGASCALE_* settings the queued resource gives each
# host). `watch` re-creates the whole queued resource when any slice is preempted.
#
# `watch` follows a run until WORKDIR/DONE exists: when the queued resource is preempted
# (or fails, or is gone) it deletes and re-creates it, waits for capacity, sets the new
# workers up and starts the same command; when the run exits with code 75 (preempted,
# checkpointed) it starts the same command again. Either way the run resumes from its
# last checkpoint. Any other exit code stops it with the log's path.
#
# Before a pod is paid for: run, watch, sweep (and create, given a config) first compile
# the run's train and eval steps for ACCELERATOR_TYPE on this host (python -m bov_jax.main
# --mode=compile, the TPU compiler from pip install '.[tpu]') and stop before any gcloud
# command when one does not fit the chips' HBM. Without libtpu here they say so and go on.
#
# Settings (environment):
#   PROJECT, ZONE, TPU_NAME, ACCELERATOR_TYPE (e.g. v5p-64, v4-32)   required
#   WORKDIR            run directory, a gs:// bucket path on pods  (run, watch, sweep)
#   RUNTIME_VERSION    TPU VM image       (default: tpu-ubuntu2204-base)
#   SLICES             slices of ACCELERATOR_TYPE                   (default: 1)
#   PROVISIONING       spot | reserved | on-demand                  (default: spot)
#   REMOTE_DIR         checkout location on the workers             (default: bov_jax)
#   POLL_SECONDS       how often `watch` looks                      (default: 60)
#   SKIP_COMPILE_CHECK=1  do not compile for ACCELERATOR_TYPE first
#   COMPILE_PROGRAMS   what the check compiles                      (default: train,eval)
#   PYTHON             this host's Python for the check and sweep files (default: python3)
#   DRY_RUN=1          print every gcloud command instead of running it; `watch` then
#                      takes what gcloud would have answered from DRY_RUN_STATES (queued
#                      resource states, one per look), DRY_RUN_EXIT_CODES (the run's exit
#                      code per look, "-" while it runs), DRY_RUN_DONE (yes/no per look)
#                      and, with SLICES > 1, DRY_RUN_NODE_STATES (the slices' node
#                      states per look, comma-joined: READY,PREEMPTED)
set -euo pipefail

RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
PROVISIONING="${PROVISIONING:-spot}"
REMOTE_DIR="${REMOTE_DIR:-bov_jax}"
POLL_SECONDS="${POLL_SECONDS:-60}"
SLICES="${SLICES:-1}"
PREEMPTED_EXIT=75  # bov_jax.train.PREEMPTED_EXIT
DONE_FILE=DONE     # bov_jax.rundir.DONE: the file a finished run leaves in its WORKDIR
PY="${PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() { echo "launch/tpu.sh: $*" >&2; exit 2; }
say() { echo "launch/tpu.sh: $*" >&2; }

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

# Runs a query and sets ANSWER to its output; with DRY_RUN=1 prints it and takes the next
# word of the named DRY_RUN_* list instead.
LOOK=0
query() {  # query SIMULATION_VARIABLE COMMAND...
  local sim="$1"
  shift
  if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "$@"
    printf '\n'
    local -a answers
    read -r -a answers <<< "${!sim:-}"
    ANSWER="${answers[$LOOK]:-${answers[${#answers[@]}-1]:-}}"
    if [ "$ANSWER" = "-" ]; then ANSWER=""; fi
  else
    ANSWER="$("$@" 2>/dev/null || true)"
  fi
}

[[ "$SLICES" =~ ^[1-9][0-9]*$ ]] || die "SLICES=$SLICES: expected a whole number of slices >= 1"

nodes() {  # the queued resource's TPU VMs: one, or one a slice (gcloud's --node-prefix)
  if [ "$SLICES" = 1 ]; then
    echo "$TPU_NAME"
  else
    local i
    for ((i = 0; i < SLICES; i++)); do echo "$TPU_NAME-$i"; done
  fi
}

first_node() { nodes | head -n 1; }

SLICE_ARGS=()  # the setting every command of a multi-slice run carries
[ "$SLICES" = 1 ] || SLICE_ARGS=("--config.mesh.slices=$SLICES")

quote_args() {
  local out="" a
  for a in "$@"; do out+=" $(printf '%q' "$a")"; done
  printf '%s' "$out"
}

# Compiles the run's programs for ACCELERATOR_TYPE on this host; stops (exit 1) when one
# does not fit. Arguments: the run's own (--config=FILE, --config.x=y).
compile_check() {
  if [ "${SKIP_COMPILE_CHECK:-0}" = "1" ]; then
    return 0
  fi
  if ! (cd "$HERE" && "$PY" -c "import libtpu, bov_jax" 2>/dev/null); then
    say "no TPU compiler on this host ($PY: pip install '.[tpu]', Linux x86-64):" \
      "not checking that the run fits $ACCELERATOR_TYPE"
    return 0
  fi
  say "compiling the run for $ACCELERATOR_TYPE on this host first (SKIP_COMPILE_CHECK=1 skips)"
  local rc=0
  (cd "$HERE" && "$PY" -m bov_jax.main --mode=compile --topology="$ACCELERATOR_TYPE" \
    --programs="${COMPILE_PROGRAMS:-train,eval}" "$@" > /dev/null) || rc=$?
  case "$rc" in
    0) say "it fits $ACCELERATOR_TYPE";;
    1) say "the run does not fit $ACCELERATOR_TYPE (above): nothing was started"; exit 1;;
    *) die "--mode=compile for $ACCELERATOR_TYPE failed (exit $rc, above)";;
  esac
}

tpu_ssh() {  # tpu_ssh WORKER COMMAND: WORKER all is every host of every slice
  local node
  if [ "$1" = all ]; then
    for node in $(nodes); do
      run_cmd gcloud compute tpus tpu-vm ssh "$node" --project="$PROJECT" --zone="$ZONE" \
        --worker=all --command="$2"
    done
  else
    run_cmd gcloud compute tpus tpu-vm ssh "$(first_node)" --project="$PROJECT" \
      --zone="$ZONE" --worker="$1" --command="$2"
  fi
}

cmd_create() {
  need PROJECT ZONE TPU_NAME ACCELERATOR_TYPE
  if [ $# -gt 0 ]; then
    compile_check "$@" "${SLICE_ARGS[@]}"
  fi
  local mode=()
  case "$PROVISIONING" in
    spot) mode=(--spot);;
    reserved) mode=(--reserved);;
    on-demand) mode=();;
    *) die "PROVISIONING=$PROVISIONING: expected spot, reserved or on-demand";;
  esac
  local node=(--node-id="$TPU_NAME")
  [ "$SLICES" = 1 ] || node=(--node-count="$SLICES" --node-prefix="$TPU_NAME")
  run_cmd gcloud compute tpus queued-resources create "${TPU_NAME}-qr" \
    --project="$PROJECT" --zone="$ZONE" "${node[@]}" \
    --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" "${mode[@]}"
}

cmd_setup() {
  need PROJECT ZONE TPU_NAME
  # The code only: no virtualenv, run directories, caches or git history.
  local tmp tarball
  tmp="$(mktemp -d)"
  tarball="$tmp/bov_jax_code.tgz"
  tar -czf "$tarball" -C "$HERE" --exclude=./.venv --exclude=./runs --exclude=./.git \
    --exclude='__pycache__' --exclude='*.egg-info' --exclude=./.pytest_cache .
  local node
  for node in $(nodes); do
    run_cmd gcloud compute tpus tpu-vm scp "$tarball" "$node:~/bov_jax_code.tgz" \
      --project="$PROJECT" --zone="$ZONE" --worker=all
  done
  rm -rf "$tmp"
  # The runtime set and TPU jax only (not the test tools), in a virtualenv of Python 3.12
  # (JAX 0.11 and newer need it; the TPU images' own Python is older): uv brings both.
  tpu_ssh all "mkdir -p ~/$REMOTE_DIR && tar -xzf ~/bov_jax_code.tgz -C ~/$REMOTE_DIR && cd ~/$REMOTE_DIR && python3 -m pip install -q --user uv && python3 -m uv venv -q --allow-existing --python 3.12 .venv && python3 -m uv pip install -q --python .venv/bin/python '.[tpu]'"
}

REMOTE_PY=.venv/bin/python  # the workers' interpreter, in ~/$REMOTE_DIR (cmd_setup)

main_command() {  # the training command line every worker runs
  printf '%s -m bov_jax.main --workdir=%q%s' "$REMOTE_PY" "$WORKDIR" "$(quote_args "$@")"
}

cmd_run() {
  need PROJECT ZONE TPU_NAME WORKDIR
  [ $# -gt 0 ] || die "run needs --config=FILE (and optional --config.* overrides)"
  if [ "${SLICED:-0}" != "1" ]; then
    set -- "$@" "${SLICE_ARGS[@]}"
  fi
  if [ "${CHECKED:-0}" != "1" ]; then
    need ACCELERATOR_TYPE
    compile_check "$@"
  fi
  # Detached on every worker (a closed laptop loses nothing); each worker keeps its log
  # and, when the run ends, its exit code (75: preempted, run it again).
  tpu_ssh all "cd ~/$REMOTE_DIR && rm -f ~/bov_jax_exit_code && nohup bash -c '$(main_command "$@"); echo \$? > ~/bov_jax_exit_code' > ~/bov_jax_run.log 2>&1 &"
}

qr_state() {  # sets ANSWER: the queued resource's state (empty if there is none)
  query DRY_RUN_STATES gcloud compute tpus queued-resources describe "${TPU_NAME}-qr" \
    --project="$PROJECT" --zone="$ZONE" --format='value(state.state)'
}

node_states() {  # sets ANSWER: the slices' TPU VM states, comma-joined (SLICES > 1)
  query DRY_RUN_NODE_STATES gcloud compute tpus tpu-vm list --project="$PROJECT" \
    --zone="$ZONE" --filter="name~^${TPU_NAME}-[0-9]+\$" --format='value(state)'
  ANSWER="$(printf '%s' "$ANSWER" | tr '\n' ',')"
}

run_exit_code() {  # sets ANSWER: worker 0's exit code of the run, empty while it runs
  query DRY_RUN_EXIT_CODES gcloud compute tpus tpu-vm ssh "$(first_node)" --project="$PROJECT" \
    --zone="$ZONE" --worker=0 --command="cat ~/bov_jax_exit_code 2>/dev/null"
}

workdir_done() {  # sets ANSWER to yes when WORKDIR/$DONE_FILE exists
  query DRY_RUN_DONE gcloud storage ls "${WORKDIR%/}/$DONE_FILE"
  case "$ANSWER" in ""|no) ANSWER=no;; *) ANSWER=yes;; esac
}

cmd_watch() {
  need PROJECT ZONE TPU_NAME ACCELERATOR_TYPE WORKDIR
  [ $# -gt 0 ] || die "watch needs --config=FILE (and optional --config.* overrides)"
  set -- "$@" "${SLICE_ARGS[@]}"
  compile_check "$@"
  CHECKED=1  # the runs watch starts are this one
  SLICED=1   # and carry the slices already
  local fresh=0  # workers that still need the code and a run
  while true; do
    workdir_done
    if [ "$ANSWER" = yes ]; then
      say "$WORKDIR/$DONE_FILE exists: the run is finished"
      return 0
    fi
    qr_state
    if [ "$ANSWER" = ACTIVE ] && [ "$SLICES" != 1 ]; then
      node_states  # one slice preempted: the whole run stops, so the whole resource goes
      case ",$ANSWER," in *,PREEMPTED,*|*,TERMINATED,*) ANSWER=PREEMPTED;; *) ANSWER=ACTIVE;; esac
    fi
    case "$ANSWER" in
      ACTIVE)
        if [ "$fresh" = 1 ]; then
          cmd_setup
          cmd_run "$@"
          fresh=0
        else
          run_exit_code
          case "$ANSWER" in
            "") ;;  # still running
            0) ;;   # finished: DONE is being written
            "$PREEMPTED_EXIT")
              say "the run was preempted and checkpointed: starting it again (it resumes)"
              cmd_run "$@";;
            *) die "the run exited with code $ANSWER; its log: ~/bov_jax_run.log on each worker (bash launch/tpu.sh logs)";;
          esac
        fi;;
      PREEMPTED|SUSPENDED|FAILED|"")
        say "queued resource ${TPU_NAME}-qr is ${ANSWER:-gone}: re-creating it"
        [ -n "$ANSWER" ] && cmd_delete
        cmd_create
        fresh=1;;
      *) say "queued resource ${TPU_NAME}-qr is $ANSWER: waiting for capacity";;
    esac
    LOOK=$((LOOK + 1))
    [ "${DRY_RUN:-0}" = "1" ] || sleep "$POLL_SECONDS"
  done
}

cmd_sweep() {
  need PROJECT ZONE TPU_NAME WORKDIR
  [ $# -gt 0 ] || die "sweep needs --sweep=FILE"
  [ "$SLICES" = 1 ] || die "sweep runs on one slice (SLICES=$SLICES): use run or watch per point"
  local points
  points="$(cd "$HERE" && "$PY" -m bov_jax.sweep "$@" --print --workdir_root="$WORKDIR")" ||
    die "the sweep file does not load ($PY -m bov_jax.sweep $* --print)"
  if [ "${SKIP_COMPILE_CHECK:-0}" != "1" ]; then
    need ACCELERATOR_TYPE
    local line
    local -a words args
    while IFS= read -r line; do  # each point's own settings, its run directory left out
      read -r -a words <<< "$line"
      mapfile -t args < <(printf '%s\n' "${words[@]:3}" | grep -v '^--workdir=')
      compile_check "${args[@]}"
    done <<< "$points"
  fi
  # One detached job on every worker runs the points in turn (each point uses the whole
  # pod), skipping finished ones, so running it again resumes the sweep; each point's
  # output goes to its run directory (log.txt).
  tpu_ssh all "cd ~/$REMOTE_DIR && nohup $REMOTE_PY -m bov_jax.sweep$(quote_args "$@") --local --workdir_root=$(printf '%q' "$WORKDIR") > ~/bov_jax_sweep.log 2>&1 &"
}

cmd_logs() {
  need PROJECT ZONE TPU_NAME
  tpu_ssh 0 "tail -n 100 -f ~/bov_jax_run.log"
}

cmd_ssh() {
  need PROJECT ZONE TPU_NAME
  if [ $# -gt 0 ]; then
    tpu_ssh "${WORKER:-0}" "$*"
  else
    run_cmd gcloud compute tpus tpu-vm ssh "$(first_node)" --project="$PROJECT" --zone="$ZONE" \
      --worker="${WORKER:-0}"
  fi
}

cmd_delete() {
  need PROJECT ZONE TPU_NAME
  run_cmd gcloud compute tpus queued-resources delete "${TPU_NAME}-qr" \
    --project="$PROJECT" --zone="$ZONE" --force --quiet
}

usage() {
  sed -n '2,45p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

sub="${1:-}"
[ $# -gt 0 ] && shift
case "$sub" in
  create) cmd_create "$@";;
  setup) cmd_setup "$@";;
  run) cmd_run "$@";;
  watch) cmd_watch "$@";;
  sweep) cmd_sweep "$@";;
  logs) cmd_logs "$@";;
  ssh) cmd_ssh "$@";;
  delete) cmd_delete "$@";;
  -h|--help|help) usage;;
  "") usage; exit 2;;
  *) die "unknown subcommand '$sub' (create, setup, run, watch, sweep, logs, ssh, delete)";;
esac
