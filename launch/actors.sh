#!/usr/bin/env bash
# shellcheck disable=SC2329  # the trap handlers below are invoked by trap
# launch/actors.sh: N actors on this node, pointed at a running learner's hub.
#
# Usage:  HUB=tcp://HOST:PORT [KEYS=DIR] [NUM_ACTORS=N] launch/actors.sh
#
# One actor per GPU (actor i sees only GPU i through CUDA_VISIBLE_DEVICES), or N
# processes on a CPU-only node. Each actor gets the run's config and current weights
# from the hub, so only the model path in the config must exist on this node too.
# Waits for all of them; Ctrl-C / SIGTERM stops them (each says goodbye to the hub, so
# its prompts are re-issued at once), SIGKILL after STOP_GRACE_S. Actors leave by
# themselves when the learner finishes. Exit status: 0 if every actor exited 0, else
# the first non-zero status (130 when interrupted).
#
# Environment (defaults in brackets):
#   HUB           the hub address printed by launch/learner.sh (RUN_DIR/endpoints.json: hub); required
#   KEYS          CURVE key directory, a copy of the learner's `async-rl keys DIR` (security.curve=true)
#   NUM_ACTORS    actors on this node [number of GPUs, else 1]
#   GPUS          comma-separated GPU ids, one per actor [0..NUM_ACTORS-1]; ignored without GPUs
#   NAME_PREFIX   actor names are PREFIX-i, shown in endpoints.json and logs [hostname]
#   LOG_DIR       write actor i's output to LOG_DIR/actor-i.log instead of the console
#   OMP_NUM_THREADS  CPU threads per actor [1]
#   STOP_GRACE_S  seconds between the stop request and SIGKILL [15]
#   PYTHON        the interpreter with async_rl installed [python]
set -euo pipefail

: "${HUB:?set HUB=tcp://HOST:PORT (printed by launch/learner.sh)}"
PYTHON=${PYTHON:-python}
STOP_GRACE_S=${STOP_GRACE_S:-15}
NAME_PREFIX=${NAME_PREFIX:-$(hostname)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
NUM_ACTORS=${NUM_ACTORS:-$((gpus > 0 ? gpus : 1))}
if [[ -n ${GPUS:-} ]]; then
    IFS=, read -r -a gpu_ids <<<"$GPUS"
else
    gpu_ids=()
    for ((i = 0; i < NUM_ACTORS; i++)); do gpu_ids+=("$i"); done
fi
if [[ $gpus -gt 0 && ${#gpu_ids[@]} -lt $NUM_ACTORS ]]; then
    echo "actors.sh: $NUM_ACTORS actors but only ${#gpu_ids[@]} GPU ids in GPUS" >&2
    exit 2
fi
keys_args=()
if [[ -n ${KEYS:-} ]]; then keys_args=(--keys "$KEYS"); fi
if [[ -n ${LOG_DIR:-} ]]; then mkdir -p "$LOG_DIR"; fi

# A background job starts with SIGINT ignored; the actor gets its own session (so a
# terminal's Ctrl-C reaches it only through this script) and SIGINT back, which makes it
# say goodbye to the hub on its way out.
actor_main='import os, signal, sys
os.setsid()
signal.signal(signal.SIGINT, signal.default_int_handler)
from async_rl.cli import main
try:
    sys.exit(main(sys.argv[1:]))
except KeyboardInterrupt:
    sys.exit(130)'

pids=()
stop() {
    local sig=$1
    for pid in "${pids[@]}"; do kill "-$sig" "$pid" 2>/dev/null || true; done
}
interrupted=0
on_signal() {
    if [[ $interrupted -eq 0 ]]; then
        interrupted=1
        echo "actors.sh: stopping ${#pids[@]} actor(s)" >&2
        stop INT
    fi
}
cleanup() {
    local alive
    for ((t = 0; t < STOP_GRACE_S * 10; t++)); do
        alive=0
        for pid in "${pids[@]}"; do if kill -0 "$pid" 2>/dev/null; then alive=1; fi; done
        [[ $alive -eq 1 ]] || return 0
        if [[ $t -eq 0 ]]; then stop INT; fi
        sleep 0.1
    done
    stop KILL
}
trap on_signal INT TERM HUP
trap cleanup EXIT

for ((i = 0; i < NUM_ACTORS; i++)); do
    env_args=()
    if [[ $gpus -gt 0 ]]; then env_args=("CUDA_VISIBLE_DEVICES=${gpu_ids[$i]}"); fi
    cmd=(env "${env_args[@]}" "$PYTHON" -c "$actor_main" actor --hub "$HUB" --name "$NAME_PREFIX-$i" "${keys_args[@]}")
    if [[ -n ${LOG_DIR:-} ]]; then
        "${cmd[@]}" >>"$LOG_DIR/actor-$i.log" 2>&1 &
    else
        "${cmd[@]}" &
    fi
    pids+=("$!")
done
echo "actors.sh: ${#pids[@]} actor(s) joining $HUB (pids ${pids[*]})" >&2

rc=0
for pid in "${pids[@]}"; do
    # A trap interrupts `wait` (status > 128) before the actor has exited: wait again.
    while true; do
        status=0
        wait "$pid" || status=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    if [[ $status -ne 0 && $rc -eq 0 ]]; then rc=$status; fi
done
trap - EXIT
if [[ $interrupted -eq 1 ]]; then exit 130; fi
exit "$rc"
