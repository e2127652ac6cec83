#!/usr/bin/env bash
# shellcheck disable=SC2329  # the trap handlers below are invoked by trap
# launch/learner.sh: the learner world of an async-rl run (torchrun), one call per learner node.
#
# Usage:  [ENV=...] launch/learner.sh CONFIG.yaml [key.sub=value ...]
#
# Node rank 0 first prepares the run directory exactly as `async-rl train` does
# (`async-rl prepare`: resolved config, demo model, RUN_DIR/config.yaml), then every
# node starts torchrun. Learner global rank 0 runs the coordinator, whose hub address
# appears in RUN_DIR/endpoints.json; this script prints it and the launch/actors.sh
# command to run on actor nodes. Ctrl-C / SIGTERM: the learner saves a checkpoint and
# final/, and nothing is left running. Exit status: as `async-rl train` (0, 2 for a
# config error, 3 for too many non-finite steps, 130 when interrupted, else 1, with one line
# naming the failure and the RESUME command).
#
# Environment (defaults in brackets):
#   NNODES          learner nodes [1]
#   NODE_RANK       this node's rank, 0..NNODES-1 [0]; node 0 hosts learner rank 0 (the hub)
#   NPROC_PER_NODE  learner ranks on this node [number of GPUs, else 1];
#                   learner.ranks is set to NNODES * NPROC_PER_NODE
#   MASTER_ADDR     address of node 0, reachable from every learner node [127.0.0.1]
#   MASTER_PORT     torchrun rendezvous port on node 0 [29500]
#   RDZV_BACKEND    torchrun rendezvous [c10d when NNODES=1, static otherwise: c10d ignores
#                   --node-rank, so learner rank 0 and the hub could land on any node]
#   RDZV_ID         rendezvous id, the same on every node and fresh for each launch
#                   [async-rl when NNODES=1; required otherwise]
#   RUN_DIR         run directory [config's run_dir, else runs/<name>-<timestamp>];
#                   required when NNODES>1, on storage every learner node shares
#   RESUME          a run directory to continue from its latest complete checkpoint
#                   (as `async-rl train --resume RUN`); sets RUN_DIR
#   HUB_HOST        transport.host: the address the hub, experience socket and weight-sync
#                   store bind and advertise; an address actors can reach, not 0.0.0.0
#                   [config's, i.e. 127.0.0.1: actors on this machine only]
#   HUB_PORT        transport.hub_port, a fixed port for firewalls [ephemeral]
#   EXPERIENCE_PORT transport.experience_port, a fixed port for firewalls [ephemeral]
#   STORE_PORT      transport.store_port, the weight-sync TCPStore's port, for firewalls [ephemeral]
#   KEYS            CURVE key directory (`async-rl keys DIR`): sets security.curve=true
#                   security.keys_dir=KEYS; actors then need KEYS too
#   HUB_WAIT_S      seconds to wait for endpoints.json before warning [600]
#   STOP_GRACE_S    after Ctrl-C, seconds torchrun gets before SIGKILL [60]
#   PYTHON          the interpreter with async_rl installed [python]
set -euo pipefail

usage() { sed -n '3,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 1 && $1 != -h && $1 != --help ]] || usage
config=$1
shift

PYTHON=${PYTHON:-python}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
if [[ -z ${NPROC_PER_NODE:-} ]]; then
    NPROC_PER_NODE=1
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
        if [[ ${gpus:-0} -gt 0 ]]; then NPROC_PER_NODE=$gpus; fi
    fi
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
HUB_WAIT_S=${HUB_WAIT_S:-600}
STOP_GRACE_S=${STOP_GRACE_S:-60}
if [[ $NNODES -gt 1 ]]; then
    RDZV_BACKEND=${RDZV_BACKEND:-static}
    : "${RDZV_ID:?set RDZV_ID to an id shared by all learner nodes and fresh for this launch}"
else
    RDZV_BACKEND=${RDZV_BACKEND:-c10d}
    RDZV_ID=${RDZV_ID:-async-rl}
fi
if [[ -n ${RESUME:-} ]]; then RUN_DIR=$RESUME; fi
if [[ $NNODES -gt 1 && -z ${RUN_DIR:-} ]]; then
    echo "learner.sh: set RUN_DIR (shared storage) when NNODES>1" >&2
    exit 2
fi

overrides=("$@" "learner.ranks=$((NNODES * NPROC_PER_NODE))")
if [[ -n ${RUN_DIR:-} ]]; then overrides+=("run_dir=$RUN_DIR"); fi
if [[ -n ${HUB_HOST:-} ]]; then overrides+=("transport.host=$HUB_HOST"); fi
if [[ -n ${HUB_PORT:-} ]]; then overrides+=("transport.hub_port=$HUB_PORT"); fi
if [[ -n ${EXPERIENCE_PORT:-} ]]; then overrides+=("transport.experience_port=$EXPERIENCE_PORT"); fi
if [[ -n ${STORE_PORT:-} ]]; then overrides+=("transport.store_port=$STORE_PORT"); fi
if [[ -n ${KEYS:-} ]]; then overrides+=("security.curve=true" "security.keys_dir=$(cd "$KEYS" && pwd)"); fi

checkpoint=""
if [[ $NODE_RANK -eq 0 ]]; then
    # `async-rl prepare` prints RUN_DIR, then the checkpoint when resuming; 2 on a config error.
    if ! prepared=$("$PYTHON" -m async_rl.cli prepare "$config" "${overrides[@]}" ${RESUME:+--resume "$RESUME"}); then
        exit 2
    fi
    run_dir=$(sed -n 1p <<<"$prepared")
    checkpoint=$(sed -n 2p <<<"$prepared")
    if [[ $NNODES -gt 1 ]]; then  # tells the other nodes the run directory is ready
        mkdir -p "$run_dir/launch"
        printf '%s\n' "$checkpoint" >"$run_dir/launch/$RDZV_ID.ready"
    fi
else
    run_dir=$(realpath -m "$RUN_DIR")
    ready=$run_dir/launch/$RDZV_ID.ready
    echo "learner.sh: node $NODE_RANK waiting for node 0 to prepare $run_dir" >&2
    for ((waited = 0; waited < HUB_WAIT_S * 10; waited++)); do
        [[ -f $ready ]] && break
        sleep 0.1
    done
    if [[ ! -f $ready ]]; then
        echo "learner.sh: $ready did not appear within ${HUB_WAIT_S}s (is RUN_DIR on shared storage?)" >&2
        exit 1
    fi
    checkpoint=$(sed -n 1p "$ready")
fi
echo "learner.sh: run directory $run_dir${checkpoint:+, resuming from $(basename "$checkpoint")}" >&2

export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
# torchrun, with its multi-line failure report sent to RUN_DIR/logs (async_rl.learner.world)
"$PYTHON" -m async_rl.learner.world "$run_dir" --nnodes="$NNODES" --node-rank="$NODE_RANK" \
    --nproc-per-node="$NPROC_PER_NODE" --rdzv-backend="$RDZV_BACKEND" \
    --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID" \
    -m async_rl.learner "$run_dir/config.yaml" ${checkpoint:+--resume "$checkpoint"} &
learner=$!  # a background job ignores SIGINT: Ctrl-C reaches torchrun only as the SIGTERM below

interrupted=0
on_signal() {
    if [[ $interrupted -eq 0 ]]; then
        interrupted=1
        echo "learner.sh: stopping (interrupted): the learner saves a checkpoint" >&2
        # torchrun passes SIGTERM to its workers (their own sessions) and SIGKILLs them after 30 s
        kill -TERM "$learner" 2>/dev/null || true
    fi
}
cleanup() {
    # Whatever happened, leave nothing behind: torchrun's workers live in their own sessions.
    local workers
    workers=$(pgrep -P "$learner" 2>/dev/null || true)
    if kill -0 "$learner" 2>/dev/null; then
        kill -TERM "$learner" 2>/dev/null || true
        for ((i = 0; i < STOP_GRACE_S * 10; i++)); do
            kill -0 "$learner" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$learner" 2>/dev/null || true
    fi
    for pid in $workers; do kill -KILL "$pid" 2>/dev/null || true; done
}
trap on_signal INT TERM HUP
trap cleanup EXIT

announced=0
started=$SECONDS
while kill -0 "$learner" 2>/dev/null; do
    if [[ $announced -eq 0 && -f $run_dir/endpoints.json ]]; then
        announced=1
        hub=$("$PYTHON" -c 'import sys; from async_rl.run.directory import RunDir; print(RunDir(sys.argv[1]).endpoints()["hub"])' "$run_dir")
        echo "learner.sh: hub $hub (RUN_DIR/endpoints.json); start actors with:" >&2
        echo "    HUB=$hub${KEYS:+ KEYS=<copy of $KEYS>} NUM_ACTORS=<n> launch/actors.sh" >&2
        if [[ $hub == tcp://127.* || $hub == tcp://localhost:* ]]; then
            echo "learner.sh: the hub is on loopback: only actors on this machine can join (set HUB_HOST)" >&2
        fi
    elif [[ $announced -eq 0 && $NODE_RANK -eq 0 && $((SECONDS - started)) -ge $HUB_WAIT_S ]]; then
        announced=1
        echo "learner.sh: no endpoints.json after ${HUB_WAIT_S}s; still waiting for the learner" >&2
    fi
    sleep 0.2
done
rc=0
wait "$learner" || rc=$?
trap - EXIT
cleanup

if [[ $NODE_RANK -eq 0 ]]; then
    "$PYTHON" -c 'import sys; from pathlib import Path; from async_rl.run.launcher import print_summary; print_summary(Path(sys.argv[1]))' "$run_dir" || true
fi
if [[ $interrupted -eq 1 ]]; then exit 130; fi
if [[ $rc -ne 0 ]]; then
    reason=$("$PYTHON" -c 'import sys; from async_rl.run.directory import RunDir; s = RunDir(sys.argv[1]).status() or {}; print(s.get("reason", "") if s.get("exit_code") else "")' "$run_dir" 2>/dev/null || true)
    echo "learner.sh: the learner failed: ${reason:-exit status $rc}; details in $run_dir/logs; continue from the last checkpoint with: RESUME=$run_dir launch/learner.sh $run_dir/config.yaml (on every learner node)" >&2
fi
if [[ $rc -eq 0 && -f $run_dir/status.json ]]; then
    # The learner exits 0 and records why it stopped (e.g. 3: too many non-finite steps).
    read -r code reason < <("$PYTHON" -c 'import sys; from async_rl.run.directory import RunDir; s = RunDir(sys.argv[1]).status(); print(int(s["exit_code"]), s["reason"])' "$run_dir")
    if [[ $code -ne 0 ]]; then
        echo "learner.sh: $reason" >&2
        exit "$code"
    fi
fi
exit "$rc"
