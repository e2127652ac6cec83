"""benchmarks/simulate.py's calibration on four small real
runs (1 and 2 actors x max_staleness 0 and 4): predicted samples/s within 20% of
measured, the idle fraction off exactly as the step time, mean staleness within 20% or a
quarter of the bound.

The real runs are made once per module (each ~15-35 s on the loaded 2-core machine, most
of it process start-up). Their configuration leaves the actors some margin over the
learner (16 groups per step in 2 requests of 8): with actors and learner nearly
balanced, the mean staleness at max_staleness 4 is a random walk between 0 and 4 that
load bursts from other processes decide (see the module docstring of simulate.py).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_script, subprocess_env, train

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/simulate.py"
pytestmark = pytest.mark.extended


sim = load_script("simulate")
RUNS = {(1, 0), (1, 4), (2, 0), (2, 4)}
TINY = ("train.batch_groups=16", "actors.groups_per_request=8", "eval.every=0", "train.max_steps=60",
        "learner.ranks=1")


def check(out: dict, eta: int) -> None:
    assert out["predicted_samples_per_s"] == pytest.approx(out["measured_samples_per_s"], rel=0.2), out
    if eta == 0:  # both exactly 0: compare the difference
        assert abs(out["predicted_staleness_mean"] - out["measured_staleness_mean"]) < 0.05, out
    else:  # within 20%, or a quarter of the bound: near balance the mean is a random walk (see above)
        tolerance = max(0.2 * out["measured_staleness_mean"], 0.25 * eta)
        assert abs(out["predicted_staleness_mean"] - out["measured_staleness_mean"]) <= tolerance, out


@pytest.fixture(scope="module", params=sorted(RUNS), ids=lambda p: f"{p[0]}actor-eta{p[1]}")
def real_run(request, demo_model, tmp_path_factory):
    actors, eta = request.param
    run_dir = tmp_path_factory.mktemp("sim") / f"a{actors}e{eta}"
    train(run_dir, demo_model, *TINY, f"actors.count={actors}", f"max_staleness={eta}")
    return run_dir, eta


def test_calibration_predicts_the_run(real_run):
    """`--calibrate RUN` (a subprocess, as a user runs it): one JSON line."""
    run_dir, eta = real_run
    proc = subprocess.run([sys.executable, str(SCRIPT), "--calibrate", str(run_dir)], capture_output=True, text=True,
                          timeout=60, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    check(out, eta)
    # Measured in the run: the hand-off of a batch's last push to the learner (seen: 1.6-7 ms).
    assert 0 < out["rates"]["delivery_seconds"] < 0.05, out
    # The learner's time outside its waits is replayed as measured, so the model's idle
    # fraction differs from the run's exactly as its step time does: (1 - idle) * interval
    # is the same on both sides.
    busy_ratio = (1 - out["predicted_idle_frac"]) / (1 - out["measured_idle_frac"])
    assert busy_ratio == pytest.approx(out["predicted_samples_per_s"] / out["measured_samples_per_s"], rel=0.05), out
    if eta == 0:
        assert out["measured_idle_frac"] > 0.1  # the synchronous baseline waits for its data


def test_calibration_from_metrics_alone(real_run):
    """Without trace.json two terms are missing, of opposite signs and sizes that vary with
    the machine: the actors' time outside generation (they look faster: the prediction may
    be high by up to that share of a step) and the learner's logging after the publish (it
    is counted in the step, so the model makes the actors wait for it: low by up to that
    share). Samples/s is held to 20% widened on each side by its term's share of a step in
    the traced calibration of the same run. Near balance (as on a loaded 2-core machine) the
    mean staleness at eta > 0 comes out too high (seen: 3.85 predicted, 2.02 measured); it
    is only checked at 0."""
    run_dir, eta = real_run
    out = sim.calibrate(run_dir, use_trace=False, seeds=3)
    assert not out["from_trace"]
    traced = sim.calibrate(run_dir, use_trace=True, seeds=1)["rates"]
    step_s = traced["batch_groups"] * traced["group_size"] / out["measured_samples_per_s"]
    # Each actor makes its share of the step's groups, in parallel with the others.
    actors_share = traced["overhead_seconds_per_group"] * traced["batch_groups"] / traced["actors"] / step_s
    logging_share = traced["log_seconds"] / step_s
    # Measured, and each a minority of a step (seen: actors 0.07 to just over 0.3, logging 0.08-0.21).
    assert 0 < actors_share < 0.5 and 0 < logging_share < 0.5, (actors_share, logging_share, traced)
    error = out["predicted_samples_per_s"] / out["measured_samples_per_s"] - 1
    assert -0.2 - logging_share < error < 0.2 + actors_share, (error, actors_share, logging_share, out)
    if eta == 0:
        assert out["predicted_staleness_mean"] == 0 and out["measured_staleness_mean"] == 0, out
