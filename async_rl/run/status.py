"""How a run ended: status.json (exit code and reason) and the exit codes it uses."""
from __future__ import annotations

import json
import os
from pathlib import Path

from async_rl.run.directory import STATUS_FILE

EXIT_CONFIG = 2  # a config error found only once running (e.g. every prompt over the limit)
EXIT_NONFINITE = 3  # `async-rl train` status after repeated non-finite steps
EXIT_REWARD_ERRORS = 4  # ... after a step with too many samples scored reward.fallback
EXIT_STALLED = 5  # no experience for learner.timeout_s (every actor gone), or no actor left to restart
# Set by `async-rl train` for the learner world: it holds the run directory's lock and
# prints a failure's one console line itself.
LAUNCHER_ENV = "ASYNC_RL_LAUNCHER"


# Written by `async-rl train` once a local actor exits with actors.max_restarts used up:
# the learner then stops as soon as no actor is live, not after learner.timeout_s.
NO_RESTARTS_FILE = "actors_not_restarted.json"


def write_no_restarts(run_dir: Path, note: str) -> None:
    tmp = run_dir / (NO_RESTARTS_FILE + ".tmp")
    tmp.write_text(json.dumps({"note": note}))
    os.replace(tmp, run_dir / NO_RESTARTS_FILE)


def no_restarts(run_dir: Path) -> str | None:
    """The launcher's note on the last actor it did not restart, if any."""
    try:
        return json.loads((run_dir / NO_RESTARTS_FILE).read_text())["note"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_status(run_dir: Path, exit_code: int, reason: str) -> None:
    """How the learner ended, for the launcher (RunDir.status reads it): {"exit_code": int,
    "reason": str}."""
    tmp = run_dir / (STATUS_FILE + ".tmp")
    tmp.write_text(json.dumps({"exit_code": exit_code, "reason": reason}))
    os.replace(tmp, run_dir / STATUS_FILE)
