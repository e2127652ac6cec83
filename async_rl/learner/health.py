"""Warnings that save a run: signs that training has nothing to learn from, said once.

A run that silently learns nothing looks like any other in its progress bar. Two
patterns account for most such runs of a new model or task, and both are visible in
every batch:
- **One-token responses**: most responses stop at their first token. A chat model
  prompted without its chat template usually answers with its end-of-turn token at once.
- **No reward variance**: in every group all samples got the same reward, so every
  group-relative advantage is 0 and so is the policy gradient. All 0: the reward never
  matches (answer format, reward function, or responses cut at the length limit); all
  equal and nonzero: the task is already solved or the reward is constant.
Each is reported once, as one log line naming the likely cause, after it has held for
`metrics.warn_after_steps` steps in a row. Earlier, at step EARLY_STEPS, one line says
so when most groups of the steps so far carried no signal (their samples all scored
the same): a run starting from reward 0 on a new task, which rarely recovers on its
own, is told what to do (docs/environments.md#when-a-run-gets-no-signal) within
seconds rather than minutes.

A third sign is read after the step: **mismatch** between the actors' policy and the
learner's (`is/mismatch_kl`, importance.py) past `metrics.warn_mismatch_kl`, from stale
data or from two engines' numbers (bf16 kernels, vLLM), where token-level weights correct
less well; the line says so when the mismatch has stayed over the threshold for
MISMATCH_STEPS steps, and again each time it doubles, and points at the corrections.

An environment that answers with more text than its episodes can hold (an observation
past env.max_tokens) is reported once too, naming the environment; and **reward
hacking**: the trained reward rising while a verifiable reward watching it at weight 0
(reward.components) falls, each trend over HACKING_WINDOW steps past twice its standard
error.
"""
from __future__ import annotations

import logging
import math
from collections import deque

import numpy as np

log = logging.getLogger("async_rl.learner.health")

# Steps in a row the mismatch must stay over its threshold: one step's spike (the demo's
# first stale batch after its first update) is not a trend, and is not worth a line.
MISMATCH_STEPS = 2
EARLY_STEPS = 3  # when the early no-signal check reads the steps so far
EARLY_NO_SIGNAL_SHARE = 0.8  # "most groups": the share of groups without signal that it reports


HACKING_WINDOW = 20  # steps over which the trained reward's trend is set against a watched one's


def _shift(values: list[float]) -> tuple[float, float, float]:
    """(mean of the first half, of the second, the change when it exceeds twice its
    standard error, else 0): a trend, not a step's noise."""
    half = len(values) // 2
    a, b = np.asarray(values[:half]), np.asarray(values[half:])
    change = float(b.mean() - a.mean())
    noise = 2.0 * math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    return float(a.mean()), float(b.mean()), change if abs(change) > noise else 0.0


class RunHealth:
    def __init__(self, steps: int, uses_chat_template: bool, max_new_tokens: int,
                 mismatch_threshold: float | None = None) -> None:
        self.steps, self.uses_chat, self.max_new_tokens = steps, uses_chat_template, max_new_tokens
        self.streaks = {"one_token": 0, "no_variance": 0}
        self.warned: set[str] = set()
        self.next_mismatch = mismatch_threshold
        self.mismatch_streak = 0  # steps in a row over the threshold
        # The first EARLY_STEPS steps: groups, groups without signal, rewards' sum, samples, cut samples.
        self.early = {"steps": 0, "groups": 0, "flat": 0, "reward": 0.0, "samples": 0, "cut": 0}
        self.trend: deque[tuple[float, dict[str, float]]] = deque(maxlen=HACKING_WINDOW)

    def check_mismatch(self, step: int, stats: dict[str, float]) -> str | None:
        """Feed one step's figures; returns the mismatch warning issued now (already logged)."""
        kl = stats.get("is/mismatch_kl")
        if self.next_mismatch is None or kl is None or kl <= self.next_mismatch:
            self.mismatch_streak = 0
            return None
        self.mismatch_streak += 1
        if self.mismatch_streak < MISMATCH_STEPS:
            return None
        self.mismatch_streak = 0
        threshold, self.next_mismatch = self.next_mismatch, 2 * max(kl, self.next_mismatch)
        message = (f"step {step}: mismatch KL(actors || learner) {kl:.3g} is over {threshold:.3g} "
                   f"(token ratio max {stats.get('is/ratio_max', float('nan')):.3g}, "
                   f"{stats.get('is/masked_frac', 0.0):.1%} of tokens masked): stale data or two engines' numbers "
                   "(bf16, vLLM) past what token-level weights correct well; train.correction and what each costs: "
                   "docs/algorithms.md#off-policy-corrections")
        log.warning(message)
        return message

    def check_observations(self, step: int, cut: int, env_name: str, max_tokens: int) -> str | None:
        """The first step whose episodes were cut short by an environment's too-long
        answer: one line naming the environment (returned, already logged)."""
        if not cut or "observations_cut" in self.warned:
            return None
        self.warned.add("observations_cut")
        message = (f"step {step}: environment {env_name} answered {cut} episode(s) with more text than the "
                   f"episode could still take (env.max_tokens={max_tokens}); they end truncated, counted in "
                   "env/observations_cut: shorten the environment's answers or raise env.max_tokens")
        log.warning(message)
        return message

    def check_hacking(self, step: int, trained: float, watched: dict[str, float]) -> str | None:
        """Feed a step's trained reward (the weighted sum) and the means of the weight-0
        components watching it; one line, once, when over the last HACKING_WINDOW steps
        the trained reward rose while a watched one fell, each by more than twice its
        standard error (returned, already logged)."""
        self.trend.append((trained, watched))
        if len(self.trend) < HACKING_WINDOW or "hacking" in self.warned:
            return None
        before, after, rise = _shift([t for t, _ in self.trend])
        if rise <= 0:
            return None
        for name in watched:
            series = [w[name] for _, w in self.trend if name in w]
            if len(series) < HACKING_WINDOW:
                continue
            was, now, fall = _shift(series)
            if fall < 0:
                self.warned.add("hacking")
                message = (f"step {step}: the trained reward rose ({before:.3g} -> {after:.3g}) while reward/{name}, "
                           f"watched at weight 0, fell ({was:.3g} -> {now:.3g}) over the last {HACKING_WINDOW} steps: "
                           "the policy may be gaming the trained reward (reward hacking); the held-out eval/accuracy "
                           "is scored by the task's own reward")
                log.warning(message)
                return message
        return None

    def check_steps(self, step: int, advantage: str) -> str | None:
        """The first step whose reward came step by step under an estimator that uses
        only each sample's reward: one line (returned, already logged)."""
        if advantage == "grpo_process" or "steps" in self.warned:
            return None
        self.warned.add("steps")
        message = (f"step {step}: the reward gives step rewards, which train.advantage.name={advantage} leaves "
                   "unused (it trains on each sample's reward); train.advantage.name=grpo_process trains on them")
        log.warning(message)
        return message

    def check(self, rewards: np.ndarray, lengths: np.ndarray, truncated: np.ndarray, group_size: int) -> list[str]:
        """Feed one batch (per-sample rewards, response lengths and truncation flags, in
        whole groups); returns the warnings issued now (already logged)."""
        grouped = rewards.reshape(-1, group_size)
        flat = grouped.max(axis=1) == grouped.min(axis=1)
        findings = {"one_token": float((lengths <= 1).mean()) > 0.5, "no_variance": bool(flat.all())}
        issued = []
        early = self._early(flat, rewards, truncated)
        if early is not None:
            issued.append(early)
            log.warning(early)
        for name, present in findings.items():
            self.streaks[name] = self.streaks[name] + 1 if present else 0
            if self.streaks[name] >= self.steps and name not in self.warned:
                self.warned.add(name)
                issued.append(self._message(name, rewards, truncated))
                log.warning(issued[-1])
        return issued

    def _early(self, flat: np.ndarray, rewards: np.ndarray, truncated: np.ndarray) -> str | None:
        """At step EARLY_STEPS, the early no-signal line, when most groups so far had none."""
        e = self.early
        if e["steps"] >= EARLY_STEPS:
            return None
        e["steps"] += 1
        e["groups"] += int(flat.size)
        e["flat"] += int(flat.sum())
        e["reward"] += float(rewards.sum())
        e["samples"] += int(rewards.size)
        e["cut"] += int(truncated.sum())
        if e["steps"] < EARLY_STEPS or e["flat"] < EARLY_NO_SIGNAL_SHARE * e["groups"]:
            return None
        cut = e["cut"] / e["samples"]
        return (f"step {EARLY_STEPS}: {e['flat'] / e['groups']:.0%} of groups ({e['flat']} of {e['groups']}) in the "
                f"first {EARLY_STEPS} steps carry no learning signal (all their samples scored the same; mean reward "
                f"{e['reward'] / e['samples']:.3g}"
                + (f", {cut:.0%} of responses cut at actors.max_new_tokens={self.max_new_tokens}" if cut > 0.25 else "")
                + "): the policy gradient is near zero, and a run like this rarely recovers on its own; what to do: "
                "docs/environments.md#when-a-run-gets-no-signal")

    def _message(self, name: str, rewards: np.ndarray, truncated: np.ndarray) -> str:
        if name == "one_token" and self.max_new_tokens <= 1:
            return f"most responses are one token long for {self.steps} steps: actors.max_new_tokens is 1"
        if name == "one_token":
            cause = ("the model ends its turn at once; a chat model needs its chat template (task.chat_template: it is "
                     "off or the tokenizer has none)" if not self.uses_chat else
                     "the model ends its turn at once; check the prompt format and the stop tokens")
            return f"most responses are one token long for {self.steps} steps: {cause}"
        mean = float(rewards.mean())
        if mean == 0.0:
            cut = float(truncated.mean())
            cause = ("no response ever scores: check that the reward function reads the answer in the format the "
                     "model writes (see the samples in TensorBoard's text tab)"
                     + (f"; {cut:.0%} of responses are cut at actors.max_new_tokens={self.max_new_tokens}"
                        if cut > 0.25 else ""))
        else:
            cause = f"every sample scores {mean:.3g}: the task is solved or the reward does not depend on the response"
        return (f"every group has the same reward for all its samples for {self.steps} steps, so the policy gradient "
                f"is zero: {cause}")
