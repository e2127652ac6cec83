"""FSDP2 over gloo: the learner's real train_step on 2 ranks equals a 1-rank run."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env
from safetensors.torch import load_file

WORKER = Path(__file__).parents[1] / "workers" / "fsdp_step.py"


def run_step(tmp_path: Path, ranks: int, variant: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{variant}-{ranks}.safetensors"
    env = subprocess_env()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                           str(WORKER), str(out), variant, str(tmp_path / f"model-{ranks}")],
                          timeout=120, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return load_file(out)


# The step runs in float64 (tests/workers/fsdp_step.py), where the two runs' orders of
# summation differ by ~1e-16. A few steps stay float32 on both paths (the batch's
# log-probs and rewards, advantages, the critic's values, transformers' RMSNorm), and a
# rounding to float32 there may land on either side: a few float32 epsilons of the scale
# of the gradients flowing through it.
BOUND = 16 * torch.finfo(torch.float32).eps


# ppo and gae (two models) in the default job; the other losses and layouts shard alike
# and run in the extended job.
@pytest.mark.parametrize("variant", ["ppo", "gae", *(pytest.param(v, marks=pytest.mark.extended)
                                                    for v in ("ppo-flat", "opmd", "reinforce_pp"))])
def test_two_rank_step_equals_single_process(tmp_path, variant):
    """The update of every parameter (policy and critic) and every diagnostic agree."""
    single = run_step(tmp_path, 1, variant)
    sharded = run_step(tmp_path, 2, variant)
    assert single.keys() == sharded.keys()
    updates = [name for name in single if not name.startswith("__")]
    # One tensor's update can cancel far below the gradients that flow through it: the
    # scale is the run's largest update.
    scale = max(float(single[name].abs().max()) for name in updates)
    for name in updates:
        assert float((sharded[name] - single[name]).abs().max()) <= BOUND * scale, name
    # Diagnostics are means and norms of per-token figures of order 1 (log-probs, ratios,
    # advantages of 0/1 rewards), so their rounding is relative to at least 1, even where
    # a mean cancels toward 0.
    for got, want in zip(sharded["__stats__"].tolist(), single["__stats__"].tolist()):
        assert abs(got - want) <= BOUND * max(abs(want), 1.0), (got, want)
    # The update is not trivially zero: SGD with lr=1 moved the weights by the gradient.
    assert float(single["__loss__"]) != 0.0
    assert all(float(single[name].abs().max()) > 0 for name in updates if not name.startswith("critic.")), updates
