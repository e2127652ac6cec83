#!/usr/bin/env bash
# launch/local.sh: the one-machine path, learner ranks and actors on this node.
#
# Usage:  launch/local.sh CONFIG.yaml [key.sub=value ...] [--resume RUN_DIR]
#
# A thin wrapper around `async-rl train` (same arguments, same exit status): it starts
# the learner (torchrun for learner.ranks > 1, one child process otherwise), waits for
# the hub, starts actors.count actors, and on Ctrl-C saves a checkpoint and final/.
# For several machines see launch/learner.sh and launch/actors.sh (launch/README.md).
#
# Environment:
#   PYTHON  the interpreter with async_rl installed [python]
set -euo pipefail

if [[ $# -lt 1 ]]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
exec "${PYTHON:-python}" -m async_rl.cli train "$@"
