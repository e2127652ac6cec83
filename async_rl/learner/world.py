"""The learner world as `async-rl train` starts it: torchrun, run in this process.

    python -m async_rl.learner.world RUN_DIR TORCHRUN_ARGS...

torchrun reports a failed world with its own multi-line log and a ChildFailedError
traceback; here that report goes to RUN_DIR/logs/torchrun.log, and the failure becomes
one reason in status.json, which the launcher prints as its one line with the
`--resume` command. The reason names the root cause: a rank killed by a signal from
outside (its peers' "connection closed" errors follow from it), else the rank whose
error was written first. launch/learner.sh runs it too (there is no launcher
to print the line: the ranks print their own, see process.py, and the script
prints the `--resume` command). With several learner nodes each writes its own log,
torchrun-node<K>.log, and node 0 alone the status.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from async_rl.run.processes import die_with_parent
from async_rl.run.status import write_status

TORCHRUN_LOG = "torchrun.log"


def _error_file(logs: Path, rank: int) -> Path | None:
    """Where rank `rank` wrote its failure (learner-rankN.err; sft-rankN.err, rm-rankN.err
    when the world trains offline: run/offline.py)."""
    return next(iter(sorted(logs.glob(f"*-rank{rank}.err"))), None)


def root_cause(failures: dict, logs: Path) -> str:
    """One line naming the failure the others follow from. `failures`: torchrun's
    {global rank: ProcessFailure}, the ranks that had exited non-zero when it noticed
    (ranks it stops afterwards are not in it)."""
    killed = sorted(r for r, f in failures.items() if f.exitcode < 0)
    if killed:
        f = failures[killed[0]]
        return f"learner rank {killed[0]} (pid {f.pid}) was killed by {f.signal_name()}"
    written = {r: path for r in failures if (path := _error_file(logs, r)) is not None}
    if written:
        rank = min(written, key=lambda r: written[r].stat().st_mtime_ns)
        reason = written[rank].read_text(errors="replace").splitlines()[0]
        return reason
    rank = min(failures)
    return f"learner rank {rank} (pid {failures[rank].pid}) exited with status {failures[rank].exitcode}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir, torchrun_args = Path(argv[0]), argv[1:]
    die_with_parent()  # the launcher's death ends the world; the ranks die with this process
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # Off the console (torch gives this logger its own stderr handler): the launcher
    # says what matters in one line.
    torch_dist_log = logging.getLogger("torch.distributed")
    for h in list(torch_dist_log.handlers):
        torch_dist_log.removeHandler(h)
    # A full disk must not turn each of torchrun's log lines into a traceback on stderr.
    logging.raiseExceptions = False
    args = parse_args(torchrun_args)
    # One log per learner node (they may share RUN_DIR); node 0 alone writes status.json.
    node = int(args.node_rank or 0)
    log_file = logs / (TORCHRUN_LOG if node == 0 else TORCHRUN_LOG.replace(".log", f"-node{node}.log"))
    handler = logging.FileHandler(log_file, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    torch_dist_log.addHandler(handler)
    torch_dist_log.propagate = False

    try:
        run(args)
    except ChildFailedError as err:
        try:
            with open(log_file, "a") as out:
                out.write(err.format_msg() + "\n")
        except OSError:
            pass  # the disk may be what failed; the reason below still reaches the launcher
        reason = root_cause(err.failures, logs)
    except Exception as err:  # the rendezvous, a port: torchrun itself failed
        reason = f"torchrun: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    else:
        return 0
    if node != 0:
        print(f"async-rl: {reason}", file=sys.stderr, flush=True)
        return 1
    try:
        write_status(run_dir, 1, reason)
    except OSError:
        print(f"async-rl: {reason}", file=sys.stderr, flush=True)  # the disk may be what failed
    return 1


if __name__ == "__main__":
    sys.exit(main())
