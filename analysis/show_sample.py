"""One trained sample of a run, as the conversation it was, checked against the chat
template: what `metrics.samples_every` wrote to RUN/samples.jsonl (run/samples.py).

    python analysis/show_sample.py RUN [--step N] [--index K] [--no-check]   # or RUN/samples.jsonl

Prints the sample's prompt, then its response cut into turns: the policy's (its
tokens, the versions that sampled them, their text) and the environment's (the text
the chat template put between two policy turns). Then the checks, each `ok` or what
differs, with the run's own tokenizer and task:
  prompt       the prompt's tokens are what the run's prompt format (chat template,
               system prompt) makes of the task's prompt with that id;
  turns        each environment turn begins with the template's closing of the
               assistant's turn (less the stop token the policy sampled) and ends with
               the header of the next assistant turn;
  tokens       each environment turn's tokens are its text's tokens again (nothing was
               re-tokenized across a turn's border);
  known        no token of the prompt or an environment turn is the tokenizer's unknown
               token: text the tokenizer cannot write reached the policy as <unk>.
Exit status 1 when a check fails. `--step` picks the first sample of that step
(default the last step dumped), `--index` the sample within it. A damaged line of
samples.jsonl is one line on stderr and skipped; a run directory without a readable
config or model is one line, exit 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from async_rl.config import ConfigError, load_config
from async_rl.run.samples import SAMPLES_FILE, read_samples


def turns_of(mask: list[int]) -> list[tuple[str, int, int]]:
    """(who, start, end) runs of the policy's (1) and the environment's (0) tokens."""
    runs: list[tuple[str, int, int]] = []
    for i, m in enumerate(mask):
        who = "policy" if m else "environment"
        if runs and runs[-1][0] == who:
            runs[-1] = (who, runs[-1][1], i + 1)
        else:
            runs.append((who, i, i + 1))
    return runs


def pick(run: Path, step: int | None, index: int) -> dict:
    path = run / SAMPLES_FILE
    if not path.exists():
        raise SystemExit(f"show_sample: {path} does not exist (set metrics.samples_every)")
    samples, damaged = read_samples(path)
    for note in damaged:
        print(f"show_sample: {path} {note}; skipped", file=sys.stderr)
    if not samples:
        raise SystemExit(f"show_sample: {path} has no whole sample")
    step = samples[-1]["step"] if step is None else step
    at = [s for s in samples if s["step"] == step]
    if not at or index >= len(at):
        raise SystemExit(f"show_sample: no sample {index} at step {step} (steps dumped: "
                         f"{sorted({s['step'] for s in samples})})")
    return at[index]


def render(sample: dict, tokenizer) -> list[str]:
    lines = [f"step {sample['step']}, prompt {sample['prompt_id']}, sample {sample['sample']}, actor "
             f"{sample['actor_id']}, version {sample['version']}, reward {sample['reward']:.3g}"
             + (", truncated" if sample["truncated"] else ""),
             f"--- prompt ({len(sample['prompt_ids'])} tokens)", sample["prompt_text"]]
    ids, versions = sample["response_ids"], sample["token_versions"]
    for who, a, b in turns_of(sample["policy_mask"]):
        detail = f", versions {min(versions[a:b])}-{max(versions[a:b])}" if who == "policy" else ""
        lines += [f"--- {who} ({b - a} tokens{detail})", tokenizer.decode(ids[a:b], skip_special_tokens=False)]
    return lines


def checks(sample: dict, run: Path) -> list[tuple[str, str]]:
    from async_rl.actor.rollout.turns import TurnFormat
    from async_rl.tasks import PromptIndex, task_from_config
    from async_rl.tasks.prompt_format import prompt_format_for

    cfg = load_config(run / "config.yaml")
    prompt_format = prompt_format_for(cfg.model.path, cfg.task)
    tokenizer = prompt_format.tokenizer
    results = []
    try:
        prompt = PromptIndex(task_from_config(cfg.task, cfg.seed))[sample["prompt_id"]]
    except (IndexError, KeyError, ValueError):
        prompt = None
    want = prompt_format.encode(prompt) if prompt is not None else None
    results.append(("prompt", f"the run's task has no prompt {sample['prompt_id']}" if want is None else
                    "ok" if want == sample["prompt_ids"] else
                    f"the run's prompt format gives {len(want)} tokens, the sample has {len(sample['prompt_ids'])}: "
                    f"{tokenizer.decode(want, skip_special_tokens=False)!r}"))
    ids = sample["response_ids"]
    turns = [(who, a, b) for who, a, b in turns_of(sample["policy_mask"]) if who == "environment"]
    unknown = unknown_tokens(tokenizer, sample["prompt_ids"], [ids[a:b] for _, a, b in turns])
    if not turns:
        return [*results, ("turns", "single turn: nothing to check"), ("tokens", "single turn: nothing to check"),
                ("known", unknown)]
    turn_format = TurnFormat(prompt_format)
    problems, retokenized = [], []
    for _, a, b in turns:
        text = tokenizer.decode(ids[a:b], skip_special_tokens=False)
        stop = tokenizer.decode([ids[a - 1]], skip_special_tokens=False) if a else ""
        closing, header = turn_format.frame(stop)
        if not text.startswith(closing):
            problems.append(f"the turn at token {a} does not begin with the template's closing {closing!r}: "
                            f"{text[:40]!r}")
        if not text.endswith(header):
            problems.append(f"the turn at token {a} does not end with the next assistant header {header!r}: "
                            f"{text[-40:]!r}")
        if list(tokenizer(text, add_special_tokens=False)["input_ids"]) != ids[a:b]:
            retokenized.append(str(a))
    results.append(("turns", "ok" if not problems else "; ".join(problems)))
    results.append(("tokens", "ok" if not retokenized else
                    f"the environment turns at tokens {', '.join(retokenized)} tokenize differently from their text"))
    results.append(("known", unknown))
    return results


def unknown_tokens(tokenizer, prompt_ids: list[int], environment_turns: list[list[int]]) -> str:
    """`ok`, or how many of the prompt's and the environment's tokens are the unknown
    token (their text was not the text the policy saw)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return "ok"
    in_prompt, in_turns = prompt_ids.count(unk), sum(turn.count(unk) for turn in environment_turns)
    if not in_prompt and not in_turns:
        return "ok"
    return (f"{in_prompt} prompt and {in_turns} environment tokens are {tokenizer.unk_token!r}: the tokenizer cannot "
            "write some of their text, and the policy saw the unknown token there")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args(argv)
    if args.run.is_file() and args.run.name == SAMPLES_FILE:  # RUN/samples.jsonl itself: its run
        args.run = args.run.parent
    if not args.run.is_dir():
        print(f"show_sample: {args.run} is not a run directory (give RUN, which holds {SAMPLES_FILE} and config.yaml)",
              file=sys.stderr)
        return 2
    sample = pick(args.run, args.step, args.index)
    from async_rl.models.loading import load_tokenizer

    try:
        cfg = load_config(args.run / "config.yaml")
        tokenizer = load_tokenizer(cfg.model.path)
    except (ConfigError, OSError, ValueError) as err:
        print(f"show_sample: {args.run}: cannot read its config or model ({str(err).splitlines()[0]})",
              file=sys.stderr)
        return 2
    print("\n".join(render(sample, tokenizer)))
    if args.no_check:
        return 0
    results = checks(sample, args.run)
    print("--- checks")
    for name, outcome in results:
        print(f"{name:8s} {outcome}")
    return 0 if all(o == "ok" or o.startswith("single turn") for _, o in results) else 1


if __name__ == "__main__":
    sys.exit(main())
