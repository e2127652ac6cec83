"""The discrete-event model (benchmarks/pipeline_model.py) against hand-computed cases and
its invariants; benchmarks/simulate.py's CLI; benchmarks/pinned_check.py's speedup table.
(The calibration on real runs: tests/integration/test_simulate_calibration.py.)"""
import importlib.util
import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks/simulate.py"


model = load_script("pipeline_model")  # the event model
sim = load_script("simulate")  # its CLI and calibration
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

B, G = 8, 4
EXACT = dict(batch_groups=B, group_size=G, gen_cv=0.0, step_cv=0.0, request_seconds=0.0, log_seconds=0.0)


def run_sim(**kw) -> list[dict]:
    return model.Sim(model.Params(**{**EXACT, **kw})).run()


def window(log: list[dict], skip: int = 10) -> dict:
    return model.window_summary(log, skip, B * G)


# -- hand-computable cases ---------------------------------------------------------------
@pytest.mark.parametrize("step_s, delivery", [(0.015, 0.0), (0.035, 0.0), (0.015, 0.004)])
def test_synchronous_one_actor_period(step_s, delivery):
    """eta = 0, one actor, one request per batch. The learner sees the batch `delivery`
    after the push, steps, gathers and publishes; the actor, polling every 0.02 s since it
    pushed, joins at its first poll after the publish, receives, generates B groups; so
    one step takes B*gen + ceil((delivery + step + sync) / poll) * poll + transfer."""
    gen, sync_s, transfer = 0.004, 0.003, 0.001
    log = run_sim(actors=1, groups_per_request=B, max_staleness=0, steps=40, gen_seconds_per_group=[gen],
                  step_seconds=step_s, sync_seconds=sync_s, broadcast_seconds=transfer, delivery_seconds=delivery)
    poll = model.POLL_SECONDS
    period = B * gen + math.ceil((delivery + step_s + sync_s) / poll) * poll + transfer
    w = window(log)
    assert w["samples_per_s"] == pytest.approx(B * G / period, rel=1e-9)
    assert w["idle_frac"] == pytest.approx((period - step_s - sync_s) / period, rel=1e-9)
    assert w["staleness_mean"] == 0 and w["staleness_max"] == 0
    assert all(r["counts"] == {0: B * G} for r in log)


def test_learner_bound_throughput_and_staleness():
    """Fast actors: samples/s -> B*G / (step + sync), no idle time, and every group is
    consumed exactly eta versions after the weights that made it."""
    step_s, sync_s = 0.02, 0.002
    log = run_sim(actors=4, groups_per_request=2, max_staleness=2, steps=60, gen_seconds_per_group=[1e-5],
                  step_seconds=step_s, sync_seconds=sync_s, broadcast_seconds=0.0005)
    w = window(log, skip=15)
    assert w["samples_per_s"] == pytest.approx(B * G / (step_s + sync_s), rel=1e-9)
    assert w["idle_frac"] == pytest.approx(0.0, abs=1e-12)
    assert w["staleness_dist"] == {2: 1.0}


def test_actor_bound_throughput():
    """Instant learner, one actor asking for whole batches, room to run ahead (eta 4):
    samples/s is the actor's, B*G / (B*gen) at most, less by at most one transfer per step."""
    gen, transfer = 0.004, 0.001
    log = run_sim(actors=1, groups_per_request=B, max_staleness=4, steps=60, gen_seconds_per_group=[gen],
                  step_seconds=1e-6, sync_seconds=0.0, broadcast_seconds=transfer)
    w = window(log, skip=15)
    assert B * G / (B * gen + transfer) <= w["samples_per_s"] <= B * G / (B * gen)
    assert w["idle_frac"] > 0.99
    assert w["staleness_max"] <= 1  # the learner waits for each batch: nothing gets old


def test_two_actors_double_the_actor_bound_rate():
    one = window(run_sim(actors=1, groups_per_request=4, max_staleness=4, steps=60, gen_seconds_per_group=[0.004],
                         step_seconds=1e-6, sync_seconds=0.0, broadcast_seconds=0.0), skip=15)
    two = window(run_sim(actors=2, groups_per_request=4, max_staleness=4, steps=60, gen_seconds_per_group=[0.004],
                         step_seconds=1e-6, sync_seconds=0.0, broadcast_seconds=0.0), skip=15)
    assert two["samples_per_s"] == pytest.approx(2 * one["samples_per_s"], rel=0.02)


def test_pauses_in_the_learner_bound_regime_add_their_length():
    """With the learner the bottleneck, an evaluation every 5 steps adds exactly its length."""
    kw = dict(actors=2, groups_per_request=4, max_staleness=2, steps=60, gen_seconds_per_group=[1e-5],
              step_seconds=0.02, sync_seconds=0.002, broadcast_seconds=0.0005)
    base = window(run_sim(**kw), skip=15)
    paused = window(run_sim(**kw, eval_every=5, eval_seconds=0.1), skip=15)
    assert paused["window_seconds"] == pytest.approx(base["window_seconds"] + 9 * 0.1, rel=1e-9)  # after 15..55


def test_coupled_broadcast_waits_for_the_slowest_actor():
    kw = dict(actors=2, groups_per_request=4, max_staleness=1, steps=60, gen_seconds_per_group=[0.001, 0.006],
              step_seconds=0.01, sync_seconds=0.001, broadcast_seconds=0.001)
    free = window(run_sim(**kw, broadcast_coupled=False), skip=15)
    coupled = window(run_sim(**kw), skip=15)
    assert coupled["samples_per_s"] < free["samples_per_s"]


def test_staleness_never_exceeds_the_bound():
    """Random configurations, heterogeneous actors, noisy durations, sync.every > 1."""
    rng = random.Random(0)
    for trial in range(40):
        eta = rng.randint(0, 4)
        p = model.Params(actors=rng.randint(1, 5), batch_groups=rng.choice([4, 8, 12]), group_size=2,
                       groups_per_request=rng.randint(1, 12), max_staleness=eta, sync_every=rng.randint(1, eta + 1),
                       steps=30, gen_seconds_per_group=[rng.uniform(1e-4, 5e-3) for _ in range(3)],
                       step_seconds=rng.uniform(1e-3, 0.05), sync_seconds=rng.uniform(0, 0.01),
                       broadcast_seconds=rng.uniform(0, 0.02), broadcast_coupled=rng.random() < 0.5,
                       gen_cv=0.5, step_cv=0.5, broadcast_cv=1.0)
        log = model.Sim(p, seed=trial).run()
        assert len(log) == p.steps
        seen = {k for r in log for k in r["counts"]}
        assert max(seen) <= eta and min(seen) >= 0, (trial, p)
        if eta == 0:
            assert seen == {0}


def test_impossible_sync_every_is_rejected():
    with pytest.raises(ValueError, match="deadlock"):
        model.Sim(model.Params(max_staleness=1, sync_every=3))


# -- CLI ---------------------------------------------------------------------------------
def test_cli_explicit_rates(capsys):
    assert sim.main(["--gen-seconds-per-group", "0.004", "--step-seconds", "0.015", "--sync-seconds", "0.003",
                     "--broadcast-seconds", "0.001", "--request-seconds", "0", "--gen-cv", "0", "--step-cv", "0",
                     "--batch-groups", "8", "--group-size", "4", "--groups-per-request", "8", "--max-staleness", "0",
                     "--steps", "40", "--actors", "1", "--seeds", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_samples_per_s"] == pytest.approx(B * G / (B * 0.004 + 0.02 + 0.001), rel=1e-3)
    assert out["predicted_staleness_mean"] == 0


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib not installed")
def test_cli_sweep_table_and_plot(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert sim.main(["--sweep", "--actors", "1..3", "6", "--staleness", "0", "2", "--gen-seconds-per-group", "0.004",
                     "--step-seconds", "0.02", "--batch-groups", "8", "--group-size", "4", "--groups-per-request", "4",
                     "--steps", "60", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| actors | max_staleness 0 | max_staleness 2 |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [1, 2, 3, 6]
    assert "- max_staleness 2: " in out and png.stat().st_size > 1000


# -- calibration on real runs ------------------------------------------------------------


def test_in_flight_syncs_inside_generate_are_not_counted_twice():
    from types import SimpleNamespace as Span

    spans = [Span(name="generate", start_s=0.0, dur_s=1.0), Span(name="sync", start_s=0.4, dur_s=0.1),  # in flight
             Span(name="sync", start_s=1.2, dur_s=0.3),  # between batches
             Span(name="generate", start_s=2.0, dur_s=1.0),
             Span(name="sync", start_s=2.9, dur_s=0.3)]  # overlaps the end
    assert [s.start_s for s in sim._outside_generate(spans, "sync")] == [1.2, 2.9]
    assert sim._outside_generate([Span(name="sync", start_s=0.0, dur_s=1.0)], "sync")[0].dur_s == 1.0


def test_delivery_is_from_the_completing_push_to_the_learners_wake():
    """Per wait of the window: from the start of the last push begun before the learner
    woke (a push's span may end after it), the median over waits."""
    from async_rl.run.directory import TraceSpan as Span

    learner = [Span("learner", "train-step", 0.0, 1.0)]
    actor = []
    for k, (push_s, woke_s) in enumerate([(1.5, 1.502), (3.5, 3.503), (5.5, 5.510)]):
        start = 1.0 + 2 * k
        learner += [Span("learner", "wait-for-data", start, woke_s - start),
                    Span("learner", "train-step", woke_s, 0.4)]
        actor += [Span("actor-0", "push", push_s - 0.3, 0.001),  # an earlier push of the batch
                  Span("actor-0", "push", push_s, 0.005)]  # ends after the learner woke
    run = SimpleNamespace(spans=lambda prefix: [s for s in learner + actor if s.track.startswith(prefix)])
    assert sim.delivery_seconds(run, skip=0) == pytest.approx(0.003)
    assert sim.delivery_seconds(SimpleNamespace(spans=lambda prefix: learner if prefix == "learner" else []),
                                skip=0) is None


def test_pinned_check_speedup_table_matches_hand_values():
    """Generation of a batch r x slower than training it, no sync cost, n actors on their
    own devices sharing each batch: synchronous steps take (r / n + 1) t, asynchronous
    ones max(r / n, 1) t."""
    spec = importlib.util.spec_from_file_location("pinned_check", ROOT / "benchmarks/pinned_check.py")
    pinned = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pinned)
    # Seconds-long steps, so that the hub's 20 ms Wait quantum is negligible; 2 groups per
    # request, so that 8 actors can share a batch.
    p = model.Params(**{**EXACT, "batch_groups": 16, "groups_per_request": 2, "step_seconds": 1.0,
                      "gen_seconds_per_group": [0.1], "sync_seconds": 0.0, "broadcast_seconds": 0.0})
    # No variation (EXACT): one seed says what three would; 100 steps reach the steady state.
    rows = [line.split(" | ") for line in pinned.speedup_table(p, staleness=2, steps=100, seeds=1).splitlines()[2:]]
    assert [row[0] for row in rows] == ["| 2x", "| 3x", "| 4x", "| 5x"]
    for r, row in zip((2, 3, 4, 5), rows):
        speedups = [float(cell.strip(" |x")) for cell in row[1:]]
        hand = [(r / n + 1) / max(r / n, 1) for n in (1, 2, 4, 8)]
        assert speedups == pytest.approx(hand, rel=0.1), (r, speedups, hand)
