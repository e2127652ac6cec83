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


# ppo and gae (two models) in the default job; the other losses and layouts shard alike
# and run in the extended job.
@pytest.mark.parametrize("variant", ["ppo", "gae", *(pytest.param(v, marks=pytest.mark.extended)
                                                    for v in ("ppo-flat", "opmd", "reinforce_pp"))])
def test_two_rank_step_equals_single_process(tmp_path, variant):
    """Parameters after the step (policy and critic) and every diagnostic agree."""
    single = run_step(tmp_path, 1, variant)
    sharded = run_step(tmp_path, 2, variant)
    assert single.keys() == sharded.keys()
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], rtol=0, atol=1e-6, msg=name)
    # The update is not trivially zero: SGD with lr=1 moved the weights by the gradient.
    assert float(single["__loss__"]) != 0.0
