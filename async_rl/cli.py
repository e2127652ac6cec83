"""Command line: `async-rl train`, `async-rl actor`, `async-rl config-doc`."""
from __future__ import annotations

import argparse
import logging
import sys

from .config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="async-rl", description="Asynchronous off-policy RL fine-tuning of LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train on this machine: spawns the learner ranks and the actors")
    p_train.add_argument("config", help="YAML config file (see configs/)")
    p_train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10")
    p_actor = sub.add_parser("actor", help="one actor process that joins a running hub")
    p_actor.add_argument("--hub", required=True, help="the hub address, tcp://HOST:PORT (endpoints.json: hub)")
    p_actor.add_argument("--name", default=None, help="a name for logs and endpoints.json")
    sub.add_parser("config-doc", help="print the config reference as a markdown table")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    if args.command == "config-doc":
        from .config import reference_markdown

        print(reference_markdown())
        return 0
    if args.command == "actor":
        from .roles.actor import run_actor
        from .runtime import exit_now

        exit_now(run_actor(args.hub, args.name))  # the actor held gloo groups: see exit_now
    try:
        cfg = load_config(args.config, args.overrides)
        from .launcher import train

        return train(cfg)
    except ConfigError as err:
        print(f"async-rl: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
