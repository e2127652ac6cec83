"""The demo trains with every loss / correction / advantage / regularizer choice: real processes
(learner ranks, actors, ZeroMQ, weight sync), two small steps each. Learning itself is
measured by benchmarks/staleness_sweep.py; here every step must be finite, complete and
carry the diagnostics of the chosen algorithm."""
import math

import pytest
from conftest import read_metrics, train

from async_rl.run.metrics import STEP_KEYS

CASES = {
    # choice: (overrides, keys that must appear on every step line)
    "ppo-naive-drgrpo-minibatches": (["train.loss.decoupled=false", "train.advantage=drgrpo", "train.minibatches=2",
                                      "train.loss.dual_clip=3.0", "train.loss.eps_high=0.28"],
                                     ["is/clip_frac_low", "is/clip_frac_high", "is/dual_clip_frac"]),
    "ppo-decoupled-rloo-entropy": (["train.advantage=rloo", "train.entropy_coef=0.01", "train.minibatches=2",
                                    "train.agg=seq-mean-token-sum"], ["loss/entropy", "is/truncated_frac"]),
    # two ranks: the extremes of the ratio are taken over both
    "gspo-kl-reject-two-ranks": (["train.loss=gspo", "train.correction=kl_reject", "train.correction.level=token",
                                  "learner.ranks=2"], ["is/masked_frac", "is/ratio_max", "is/seq_log_ratio_q99"]),
    "cispo-sequence-mask": (["train.loss=cispo", "train.correction=sequence_mask", "train.minibatches=2"],
                            ["is/masked_seq_frac", "is/clip_frac_high"]),
    "opmd-length-norm": (["train.loss=opmd", "train.loss.length_norm=true", "train.agg=seq-mean-token-mean"],
                         ["opmd/residual_abs_mean"]),
    "reinforce_pp-kl-reward": (["train.advantage=reinforce_pp", "train.kl.coef=0.05", "train.kl.mode=reward",
                                "train.kl.estimator=k2"], ["policy/kl_ref"]),
    "remax-kl-loss": (["train.advantage=remax", "train.kl.coef=0.05", "train.kl.estimator=k1"],
                      ["policy/kl_ref", "loss/kl"]),
    "gae-critic": (["train.advantage=gae", "train.advantage.lam=0.9", "train.advantage.gamma=0.99",
                    "checkpoint.every=1"],
                   ["loss/value", "critic/value_mean", "critic/grad_norm"]),
}


# Two cases run in the extended job only, keeping the default job within its time: the
# unit tests of train_step cover their algorithms in-process.
EXTENDED = {"ppo-naive-drgrpo-minibatches", "opmd-length-norm", "cispo-sequence-mask"}


@pytest.mark.parametrize("choice", [pytest.param(c, marks=pytest.mark.extended) if c in EXTENDED else c
                                    for c in CASES])
def test_demo_trains_with(choice, tmp_path, demo_model):
    overrides, keys = CASES[choice]
    run = tmp_path / choice
    train(run, demo_model, "train.max_steps=2", "learner.ranks=1", *overrides)
    steps, evals = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert set(STEP_KEYS) | {"is/mismatch_kl", "policy/entropy", "train/response_len_mean", *keys} <= s.keys()
        bad = {k: v for k, v in s.items() if not isinstance(v, (int, float)) or not math.isfinite(v)}
        assert not bad, f"non-finite metrics: {bad}"
        assert s["wire/rejected"] == 0 and s["staleness/dropped"] == 0
        assert 0.0 < s["is/ess"] <= 1.0 + 1e-9 and s["policy/entropy"] > 0
    assert evals[-1]["step"] == 2
    if choice == "gae-critic":  # the critic and its optimizer are part of the resumable checkpoint
        from torch.distributed.checkpoint import FileSystemReader

        stored = FileSystemReader(str(run / "checkpoints" / "step_000001")).read_metadata().state_dict_metadata
        assert any(k.startswith("critic.") for k in stored) and any(k.startswith("critic_optim.") for k in stored)
