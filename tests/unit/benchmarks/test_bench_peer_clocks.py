import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from bench_peer import all_hit, protocol_figures, speedups  # noqa: E402

TRL = [{"step": 0, "time": 0.0, "time_with_eval": 0.0, "eval/accuracy": 0.3, "eval/accuracy@float32": 0.3},
       {"step": 10, "time": 300.0, "time_with_eval": 330.0, "eval/accuracy": 0.7, "eval/accuracy@float32": 0.6},
       {"step": 20, "time": 600.0, "time_with_eval": 660.0, "eval/accuracy": 0.7, "eval/accuracy@float32": 0.66}]
OURS = [{"step": 0, "time": 9.0, "version_time": 0.0, "eval/accuracy": 0.3, "eval/accuracy@float32": 0.3},
        {"step": 10, "time": 80.0, "version_time": 50.0, "eval/accuracy": 0.5, "eval/accuracy@float32": 0.65},
        {"step": 20, "time": 140.0, "version_time": 110.0, "eval/accuracy": 0.68, "eval/accuracy@float32": 0.7}]


def test_each_protocol_and_clock_gets_its_own_time_to_target():
    trl = protocol_figures("trl", TRL, 0.65)
    assert trl["own"] | {"curve": None} == {"step": 10, "with_eval_s": 330.0, "without_eval_s": 300.0, "curve": None}
    assert trl["float32"]["step"] == 20 and trl["float32"]["with_eval_s"] == 660.0
    ours = protocol_figures("async-rl", OURS, 0.65)  # the version's time, not when its score arrived
    assert (ours["own"]["step"], ours["own"]["with_eval_s"], ours["own"]["without_eval_s"]) == (20, 110.0, 110.0)
    assert (ours["float32"]["step"], ours["float32"]["with_eval_s"]) == (10, 50.0)
    assert ours["own"]["curve"] == [(0, 0.0, 0.3), (10, 50.0, 0.5), (20, 110.0, 0.68)]
    ratio = speedups({"protocols": trl}, {"protocols": ours})
    assert ratio["own"] == {"with_eval": 3.0, "without_eval": round(300 / 110, 3)}
    assert ratio["float32"] == {"with_eval": 13.2, "without_eval": 12.0}
    assert ratio["same_step"] == {10: 6.6, 20: 6.0}


def test_a_run_stops_only_when_every_protocol_reached_the_target():
    assert not all_hit(TRL[:2], 0.65) and all_hit(TRL, 0.65) and not all_hit([], 0.0)
    assert all_hit([{"step": 1, "eval/accuracy": 0.9}], 0.65)  # lines with one protocol: that one
