"""Our off-policy corrections, policy losses and diagnostics against the peers' own code, on the same tensors.

Four fixed-seed batches of [6, 12] float64 log-probs with right padding: behavior-proximal
gaps of 0.02, 0.2 and 0.6 per token, and `outliers` (tokens at d = +25, -25, +22, beyond the
+-20 clamp, and a response the policy moved by -12 nats per token). Each row runs one of
ours (async_rl.algorithms: corrections.correct, ppo_clip_loss, gspo_loss, cispo_loss,
importance.off_policy_figures, kl.kl_estimate) and the peer function beside it, under the
convention mapping the row states, and compares weights, masks, figures, losses and the
losses' gradients (torch.autograd.grad w.r.t. the policy log-probs). Peers' code as installed:
- verl: trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask
  and trainer.ppo.core_algos.get_policy_loss_fn("vanilla" | "gspo" | "cispo");
- AReaL: its M2PO masking (_apply_m2po_masking, _get_m2po_loss_mask) and KLEstimator,
  their source read from the installed files and exec'd into a namespace holding only
  torch (the areal package's __init__ needs its whole distributed runtime).
Our side always gets NaN/+-inf/1e30 garbage in padded positions; a peer too, unless some
output of its is then non-finite (it then gets zeros there, and the row says so). A row
agrees when its max abs difference is within tol * max(1, |peer's value|) on every batch;
one that differs names the convention and the difference left once it is applied (exit 1
on a difference no stated convention explains).

Setup: a venv seeing this repository's package and torch, the peers without their
dependency trees (which pin CUDA builds):
    python -m venv --system-site-packages VENV
    VENV/bin/pip install --no-deps verl==0.9.1 areal==1.0.4
    VENV/bin/pip install tensordict pyvers importlib_metadata ray codetiming
Run from the repository root (a few seconds on one CPU):
    VENV/bin/python benchmarks/peer_corrections.py --out benchmarks/results/peer_corrections.md
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import math
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import torch
from verl.trainer.ppo import core_algos, rollout_corr_helper
from verl.workers.config import ActorConfig

from async_rl.algorithms.cispo import cispo_loss
from async_rl.algorithms.config import CORRECTION_VARIANTS
from async_rl.algorithms.corrections import Correction, correct
from async_rl.algorithms.gspo import gspo_loss
from async_rl.algorithms.importance import off_policy_figures
from async_rl.algorithms.kl import kl_estimate
from async_rl.algorithms.ppo import ppo_clip_loss

B, T = 6, 12
BATCHES = {"gap 0.02": 0.02, "gap 0.2": 0.2, "gap 0.6": 0.6, "outliers": 0.2}
GARBAGE = torch.tensor([math.nan, math.inf, -math.inf, 1e30], dtype=torch.float64)
BOUND = 20.0  # both sides clamp token log-ratios to +-this before exp (verl's SAFETY_BOUND)
AREAL_FILES = {"areal/trainer/ppo/actor.py": ("_apply_m2po_masking", "_get_m2po_loss_mask"),
               "areal/utils/data.py": ("KLEstimator",)}


class Batch(NamedTuple):
    mask: torch.Tensor  # [B, T] bool, right padding
    behav: torch.Tensor  # the actors' log-probs
    prox: torch.Tensor  # the learner's at the step's start
    policy: torch.Tensor  # current, for PPO and CISPO: prox moved by ~0.5 per token, so the clips bite
    policy_gspo: torch.Tensor  # current, for GSPO: sequence means within ~1e-3 of prox, GSPO's clip range
    adv: torch.Tensor  # [B]


def make_batch(index: int, name: str) -> Batch:
    g = torch.Generator().manual_seed(1000 + index)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if index == 1:
        lengths[-1] = 0  # an empty response: each side must leave it out of its means
    behav = -4.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    prox = behav + BATCHES[name] * randn(B, T)
    gspo_offset, adv = 1e-3 * randn(B, T) + 5e-4 * randn(B, 1), randn(B)
    if name == "outliers":  # tokens the two engines disagree on by e^25, e^-25, e^22
        prox[0, 0], prox[1, 0], prox[3, 0] = behav[0, 0] + 25.0, behav[1, 0] - 25.0, behav[3, 0] + 22.0
        gspo_offset[2] = -12.0  # a sequence log-ratio below our GSPO clamp at -10 ...
        adv[2] = adv[2].abs()  # ... with A > 0: with A < 0 the clipped branch, gradient 0, hides it
    return Batch(torch.arange(T) < lengths[:, None], behav, prox, prox + 0.5 * randn(B, T), prox + gspo_offset, adv)


def padded(x: torch.Tensor, mask: torch.Tensor, garbage: bool = True) -> torch.Tensor:
    x = x[:, None].expand(mask.shape) if x.dim() == 1 else x
    fill = GARBAGE.repeat(x.numel() // len(GARBAGE) + 1)[: x.numel()].view_as(x) if garbage else 0.0
    return torch.where(mask, x, fill)


def finite(value: Any) -> bool:
    if isinstance(value, dict | tuple | list):
        return all(map(finite, value.values() if isinstance(value, dict) else value))
    return value is None or bool(torch.isfinite(torch.as_tensor(value, dtype=torch.float64)).all())


def call_peer(fn, mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[Any, str]:
    """fn on the tensors with garbage padding if all its outputs are then finite, else with zeros there."""
    out = fn(*(padded(x, mask) for x in tensors))
    return (out, "garbage") if finite(out) else (fn(*(padded(x, mask, False) for x in tensors)), "zeros")


def with_grad(loss_fn, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logp.clone().requires_grad_(True)
    loss = loss_fn(leaf)[0]
    return loss.detach(), torch.autograd.grad(loss, leaf)[0]


def diff(a: Any, b: Any) -> float:
    """Max abs difference over every element (tuples: over each pair); NaN counts as infinite."""
    if isinstance(a, tuple):
        return max(diff(x, y) for x, y in zip(a, b))
    d = (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs()
    return float(d.nan_to_num(nan=math.inf).max()) if d.numel() else 0.0


def verl_correction(mask: torch.Tensor, **kwargs):
    """(prox, behav) -> (IS weights or None, kept-token mask, metrics), verl's old_log_prob being our proximal."""
    def run(prox, behav):
        weights, keep, metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
            prox, behav, mask.double(), **kwargs)
        return (None if weights is None else weights.batch["rollout_is_weights"]), keep.bool(), metrics
    return run


def installed(package: str, relative: str) -> Path:
    return Path(importlib.metadata.distribution(package).locate_file(relative))


def load_areal() -> dict[str, Any]:
    namespace: dict[str, Any] = {"torch": torch}
    for relative, names in AREAL_FILES.items():
        path = installed("areal", relative)
        nodes = [n for n in ast.parse(path.read_text()).body
                 if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in names]
        exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


AREAL = load_areal()


def correction(name: str, **knobs):
    """`train.correction` as a config would give it: its variant by name, with these knobs."""
    return next(v for v in CORRECTION_VARIANTS if v.model_fields["name"].default == name)(**knobs)


def ours_correction(config, b: Batch) -> Correction:
    return correct(config, padded(b.prox, b.mask), padded(b.behav, b.mask), b.mask)


def clamped_prox(b: Batch, high: float = BOUND) -> torch.Tensor:
    """Proximal log-probs with each token's log-ratio to behav clamped to [-20, high]: one side's clamp,
    handed to the other side's code."""
    return b.behav + (b.prox - b.behav).clamp(-BOUND, high)


class Outcome(NamedTuple):
    diff: float
    scale: float  # |peer's value|, for the tolerance
    padding: str
    effect: tuple[float, float]  # (tokens truncated/masked/clipped, response tokens), or (our value, nan)
    reconciled: float = math.nan  # the difference left once the row's stated convention is applied


def correction_check(config, verl_kwargs: dict, compare: str, reconcile_sum_clamp: bool):
    def check(b: Batch) -> Outcome:
        ours = ours_correction(config, b)
        (weights, keep, _), padding = call_peer(verl_correction(b.mask, **verl_kwargs), b.mask, b.prox, b.behav)
        d = diff(ours.weights, weights) if compare == "weights" else diff(ours.keep, keep)
        reconciled = math.nan
        if reconcile_sum_clamp:  # verl given our per-token clamp; our sequence weight floored at e^-20 as verl's
            floored = torch.where(b.mask, ours.weights.clamp(min=math.exp(-BOUND)), 0.0)
            reconciled = diff(floored, verl_correction(b.mask, **verl_kwargs)(clamped_prox(b), b.behav)[0])
        touched = b.mask & (ours.truncated | ~ours.keep)
        return Outcome(d, 1.0, padding, (float(touched.sum()), float(b.mask.sum())), reconciled)
    return check


def m2po_check(threshold: float):
    def check(b: Batch) -> Outcome:
        ours = ours_correction(correction("m2po", threshold=threshold), b).keep
        theirs, padding = call_peer(lambda prox, behav: AREAL["_apply_m2po_masking"](behav, prox, b.mask, threshold),
                                    b.mask, b.prox, b.behav)
        # AReaL's convention, on ours: when we keep nothing, keep the one token of smallest d^2.
        squared = torch.where(b.mask, (b.prox - b.behav).square(), math.inf).view(-1)
        smallest = torch.zeros_like(squared, dtype=torch.bool).index_fill(0, squared.argmin(), True).view_as(ours)
        reconciled = diff(ours if ours.any() else smallest, theirs)
        return Outcome(diff(ours, theirs), 1.0, padding, (float((b.mask & ~ours).sum()), float(b.mask.sum())),
                       reconciled)
    return check


def figure_check(ours_key: str, verl_key: str, threshold: float):
    """A diagnostic against verl's token-IS metrics at `threshold`."""
    def check(b: Batch) -> Outcome:
        verl = verl_correction(b.mask, rollout_is="token", rollout_is_threshold=threshold)
        metrics, padding = call_peer(lambda prox, behav: verl(prox, behav)[2], b.mask, b.prox, b.behav)
        ours = off_policy_figures(padded(b.prox, b.mask), padded(b.behav, b.mask), b.mask)[1][ours_key].value()
        theirs = metrics[f"rollout_corr/{verl_key}"]
        # Ours on the weights verl applies: d clamped to +-20 and below log threshold.
        applied = clamped_prox(b, min(BOUND, math.log(threshold)))
        reconciled = diff(off_policy_figures(applied, b.behav, b.mask)[1][ours_key].value(), theirs)
        return Outcome(diff(ours, theirs), abs(theirs), padding, (ours, math.nan), reconciled)
    return check


def kl_check(kind: str):
    def check(b: Batch) -> Outcome:
        ours = torch.where(b.mask, kl_estimate(padded(b.prox, b.mask), padded(b.behav, b.mask), kind, clamp=10.0), 0.0)
        theirs, padding = call_peer(AREAL["KLEstimator"](kind, apply_clamp=True), b.mask, b.prox, b.behav)
        return Outcome(diff(ours, torch.where(b.mask, theirs, 0.0)), float(ours.abs().max()), padding,
                       (float((b.mask & (ours.abs() >= 10.0)).sum()), float(b.mask.sum())))
    return check


def loss_check(ours_fn, verl_name: str, agg: str, clip: tuple[float, float], policy: str = "policy",
               correction_config=None, verl_kwargs: dict | None = None, reconcile=None):
    """Loss and gradient: ours with our correction's weights; verl's with its own correction's IS weights,
    or its rejection mask as the loss mask (verl's trainer replaces response_mask by it)."""
    def check(b: Batch) -> Outcome:
        mask, logp, prox = b.mask, getattr(b, policy), padded(b.prox, b.mask)
        weights = None if correction_config is None else ours_correction(correction_config, b).weights
        ours = with_grad(lambda x: ours_fn(x, prox, b.adv, mask, weights=weights), padded(logp, mask))
        clipped = ours_fn(padded(logp, mask), prox, b.adv, mask, weights=weights)[1]["is/clip_frac"] * mask.sum()
        verl_weights, loss_mask = None, mask
        if verl_kwargs:
            verl_weights, loss_mask, _ = call_peer(verl_correction(mask, **verl_kwargs), mask, b.prox, b.behav)[0]
        config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=4,
                             clip_ratio_low=clip[0], clip_ratio_high=clip[1])
        loss_fn = core_algos.get_policy_loss_fn(verl_name)
        theirs, padding = call_peer(lambda peer_logp, peer_prox, peer_adv: with_grad(lambda x: loss_fn(
            old_log_prob=peer_prox, log_prob=x, advantages=peer_adv, response_mask=loss_mask, loss_agg_mode=agg,
            config=config, rollout_is_weights=verl_weights), peer_logp), mask, logp, b.prox, b.adv)
        reconciled = math.nan if reconcile is None else diff(reconcile(b, weights, ours, loss_mask), theirs)
        return Outcome(diff(ours, theirs), max(float(theirs[0].abs()), float(theirs[1].abs().max())), padding,
                       (float(clipped), float(mask.sum())), reconciled)
    return check


def rescaled_by_kept(b: Batch, weights, ours, loss_mask):
    """Ours divided by the kept tokens instead of all response tokens."""
    scale = float(b.mask.sum()) / max(float(loss_mask.sum()), 1.0)
    return ours[0] * scale, ours[1] * scale


def gspo_clamped_at(clamp: float):
    def loss(b: Batch, weights, ours, loss_mask):
        return with_grad(lambda x: gspo_loss(x, padded(b.prox, b.mask), b.adv, b.mask, weights=weights,
                                             log_ratio_clamp=clamp), padded(b.policy_gspo, b.mask))
    return loss


def ppo(logp, prox, adv, mask, weights):
    return ppo_clip_loss(logp, prox, adv, mask, weights=weights, eps_low=0.2, eps_high=0.28, dual_clip=3.0)


def cispo(eps_low):
    return lambda *args, weights: cispo_loss(*args, weights=weights, eps_low=eps_low, eps_high=0.28)


def corr(check: str, name: str, knobs: dict, compare: str, why: str | None = None, **verl_kwargs):
    """A correction row: ours by config name and knobs, verl's by its compute_rollout_correction_... arguments."""
    ours = f"{name}({', '.join(f'{k}={v}' for k, v in knobs.items())})"
    peer = ", ".join(f"{k}={v}" for k, v in verl_kwargs.items())
    return (check, ours, peer, 0.0 if compare == "keep" else 1e-12, why,
            correction_check(correction(name, **knobs), verl_kwargs, compare, reconcile_sum_clamp=why is not None))


def k1_bounds(low: float, high: float) -> str:
    """verl's k1 bounds keep log lo <= mean(-d) <= log hi, i.e. 1/hi <= exp(mean d) <= 1/lo."""
    return f"{1 / high!r}_{1 / low!r}"


TOKEN_IS = {"rollout_is": "token", "rollout_is_threshold": 2.0}
K3_TOKEN = {"estimator": "k3", "level": "token", "threshold": 0.05}
# (check, ours, peer's, tol, why a difference is expected, the comparison)
ROWS = [
    corr("token IS, truncate", "token", {"cap": 2.0}, "weights", **TOKEN_IS),
    corr("token IS, mask = IcePop [1e-12, 2]", "token", {"cap": 2.0, "mode": "mask"}, "weights",
         rollout_is="token", rollout_is_threshold="1e-12_2.0"),
    corr("sequence IS", "sequence_is", {"cap": 2.0}, "weights",
         "ours clamps each token's d to +-20 (`correct`), verl clamps the sum S to +-20 instead",
         rollout_is="sequence", rollout_is_threshold=2.0),
    corr("IcePop", "icepop", {"low": 0.5, "high": 5.0}, "weights", rollout_is="token", rollout_is_threshold="0.5_5.0"),
    corr("sequence mask, bounds 1/high_1/low", "sequence_mask", {"low": 0.8, "high": 1.5}, "keep",
         rollout_rs="seq_sum_k1", rollout_rs_threshold=k1_bounds(0.8, 1.5)),
    corr("geometric mask, bounds 1/high_1/low", "geometric_mask", {"low": 0.97, "high": 1.05}, "keep",
         rollout_rs="seq_mean_k1", rollout_rs_threshold=k1_bounds(0.97, 1.05)),
    corr("KL reject k3 token", "kl_reject", K3_TOKEN, "keep", rollout_rs="token_k3", rollout_rs_threshold=0.05),
    corr("KL reject k3 sequence", "kl_reject", {"estimator": "k3", "level": "sequence", "threshold": 0.02}, "keep",
         rollout_rs="seq_mean_k3", rollout_rs_threshold=0.02),
    corr("KL reject k1 token, bounds e^-t_e^t", "kl_reject", {"estimator": "k1", "level": "token", "threshold": 0.2},
         "keep", rollout_rs="token_k1", rollout_rs_threshold=k1_bounds(math.exp(-0.2), math.exp(0.2))),
    corr("KL reject k1 sequence, bounds e^-t_e^t", "kl_reject",
         {"estimator": "k1", "level": "sequence", "threshold": 0.02}, "keep",
         rollout_rs="seq_mean_k1", rollout_rs_threshold=k1_bounds(math.exp(-0.02), math.exp(0.02))),
    ("M2PO", "m2po(threshold=0.02)", "AReaL _apply_m2po_masking(m2_threshold=0.02)", 0.0, None, m2po_check(0.02)),
    ("M2PO, no token under tau", "m2po(threshold=1e-12)", "AReaL _apply_m2po_masking(m2_threshold=1e-12)", 0.0,
     "AReaL keeps the one token of smallest d^2 (it never masks all), ours none", m2po_check(1e-12)),
    ("mismatch k1", "is/mismatch_k1", "rollout_corr/kl", 1e-7, None, figure_check("is/mismatch_k1", "kl", 1e9)),
    ("mismatch k3", "is/mismatch_kl", "rollout_corr/k3_kl", 1e-7, None, figure_check("is/mismatch_kl", "k3_kl", 1e9)),
    ("ESS, nothing over the threshold", "is/ess (raw weights)", "rollout_is_eff_sample_size, threshold 1e9", 1e-7,
     "verl's weights are clamped at e^20 (its SAFETY_BOUND), ours raw",
     figure_check("is/ess", "rollout_is_eff_sample_size", 1e9)),
    ("ESS, verl's default threshold", "is/ess (raw weights)", "rollout_is_eff_sample_size, threshold 2", 1e-7,
     "verl's ESS is of its applied weights min(r, 2), ours of the raw r",
     figure_check("is/ess", "rollout_is_eff_sample_size", 2.0)),
    *((f"KL {k}", f"kl_estimate({k}, clamp=10)", f"AReaL KLEstimator('{k}'), float32", 1e-6, None, kl_check(k))
      for k in ("k1", "k2", "k3")),
    ("PPO + token IS", "ppo_clip_loss(0.2, 0.28, dual_clip=3), token-mean", "vanilla (clip_ratio_c=3), token-mean",
     1e-12, None, loss_check(ppo, "vanilla", "token-mean", (0.2, 0.28), correction_config=correction("token", cap=2.0),
                             verl_kwargs=TOKEN_IS)),
    ("PPO + k3 token reject", "ppo_clip_loss, weights 0 on rejected", "vanilla, loss mask = rejection mask", 1e-12,
     "ours keeps rejected tokens (weight 0) in the token-mean denominator, verl's trainer drops them",
     loss_check(ppo, "vanilla", "token-mean", (0.2, 0.28), correction_config=correction("kl_reject", **K3_TOKEN),
                verl_kwargs={"rollout_rs": "token_k3", "rollout_rs_threshold": 0.05}, reconcile=rescaled_by_kept)),
    ("GSPO + token IS", "gspo_loss(3e-4, 4e-4)", "gspo, seq-mean-token-mean", 1e-12,
     "ours clamps log s_i to [-10, 10], verl only above at 10",
     loss_check(lambda *args, weights: gspo_loss(*args, weights=weights), "gspo", "seq-mean-token-mean",
                (3e-4, 4e-4), "policy_gspo", correction("token", cap=2.0), TOKEN_IS, gspo_clamped_at(30.0))),
    ("CISPO + token IS", "cispo_loss(0.2, 0.28), token-mean", "cispo (clip 0.2, 0.28), token-mean", 1e-12, None,
     loss_check(cispo(0.2), "cispo", "token-mean", (0.2, 0.28), correction_config=correction("token", cap=2.0),
                verl_kwargs=TOKEN_IS)),
    ("CISPO, no lower clip", "cispo_loss(None, 0.28)", "cispo (clip_ratio_low=1.0: bound 0)", 1e-12, None,
     loss_check(cispo(None), "cispo", "token-mean", (1.0, 0.28))),
]


def provenance() -> str:
    def sha(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:12]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                              text=True).stdout.strip()
    files = [("verl", f"verl/trainer/ppo/{m.__name__.split('.')[-1]}.py") for m in (rollout_corr_helper, core_algos)]
    files += [("areal", relative) for relative in AREAL_FILES]
    return (f"verl {importlib.metadata.version('verl')} and AReaL {importlib.metadata.version('areal')} (PyPI wheels, "
            f"which carry no commit; sha256[:12] of the files run: "
            + ", ".join(f"`{relative}` {sha(installed(package, relative))}" for package, relative in files)
            + f"), torch {torch.__version__}; ours at commit {git('rev-parse', '--short', 'HEAD')}"
            + (" with uncommitted changes in async_rl/" if git("status", "--porcelain", "async_rl") else "") + ".")


def fmt(x: float) -> str:
    return "-" if math.isnan(x) else "0" if x == 0 else f"{x:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peer_corrections.md"))
    args = parser.parse_args()
    batches = {name: make_batch(i, name) for i, name in enumerate(BATCHES)}
    lines = ["# Our corrections, losses and diagnostics against verl's and AReaL's own code", "",
             f"`VENV/bin/python benchmarks/peer_corrections.py --out {args.out}` (its docstring says what and how). "
             f"Batches [{B}, {T}], float64: " + ", ".join(BATCHES) + ". " + provenance(), "",
             "| check | ours | peer's | peer padding | effect | max abs diff, random batches | outlier batch "
             "| tol | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    unexplained = []
    for check, ours, theirs, tol, why, compare in ROWS:
        outcomes = {name: compare(b) for name, b in batches.items()}
        within = {name: o.diff <= tol * max(1.0, o.scale) for name, o in outcomes.items()}
        random_diff = max(o.diff for name, o in outcomes.items() if name != "outliers")
        effects = [o.effect for o in outcomes.values()]
        effect = (f"{sum(e[0] for e in effects):.0f}/{sum(e[1] for e in effects):.0f} tokens"
                  if not math.isnan(effects[0][1]) else "ours: " + ", ".join(f"{e[0]:.3g}" for e in effects))
        padding = "garbage" if all(o.padding == "garbage" for o in outcomes.values()) else "zeros (garbage: non-finite)"
        left = max((o.reconciled for name, o in outcomes.items() if not within[name]), default=math.nan)
        where = "" if not any(within.values()) else " on " + ", ".join(n for n, ok in within.items() if not ok)
        if all(within.values()):
            verdict = "agree"
        elif why and left <= tol * max(1.0, *(o.scale for o in outcomes.values())):
            verdict = f"differs{where}: {why}; that applied, diff {fmt(left)}"
        else:
            verdict = f"DIFFERS{where}, unexplained (left after the stated convention: {fmt(left)})"
            unexplained.append(check)
        lines.append(f"| {check} | `{ours}` | `{theirs}` | {padding} | {effect} | {fmt(random_diff)} "
                     f"| {fmt(outcomes['outliers'].diff)} | {tol:g} | {verdict} |")
    lines += ["", "effect: response tokens truncated or masked (corrections, M2PO), clamped at 10 (KL), clipped by "
              "our loss's ratio clip (losses); for figures, our value per batch. Loss rows compare the loss and its "
              "gradient w.r.t. the policy log-probs. tol is relative to max(1, |peer's value|); 1e-7 for verl's "
              "figures, whose means divide by count + 1e-8. verl's trainer drops rejected tokens from the loss: "
              "compute_rollout_correction_and_add_to_batch replaces response_mask by the rejection mask, and "
              "workers/utils/padding.py's left_right_2_no_padding makes it the loss_mask the token-mean counts."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if unexplained:
        raise SystemExit(f"unexplained differences: {', '.join(unexplained)}")


if __name__ == "__main__":
    main()
