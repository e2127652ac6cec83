"""benchmarks/peer_curves.py: both systems' metric names mapped to one table, window means
against hand-computed values."""
import json

from conftest import load_script

curves = load_script("peer_curves")


def write(path, rows):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_window_means_of_both_systems_side_by_side(tmp_path, capsys):
    seed = tmp_path / "seed0"
    write(seed / "async-rl", [
        {"step": 0, "time": 1.0, "eval/accuracy": 0.25},
        *({"step": k, "time": 1.0 + k, "train/reward_mean": 0.1 * k, "train/response_len_mean": 10.0,
           "train/truncated_frac": 0.5, "learner/grad_norm": 2.0} for k in range(1, 5)),
        {"step": 2, "time": 9.0, "eval/accuracy": 0.5},
    ])
    write(seed / "trl", [
        {"step": 0, "time": 0.0, "eval/accuracy": 0.25},
        *({"step": k, "reward": 0.2, "completions/mean_length": 4.0 * k, "completions/clipped_ratio": 0.0,
           "grad_norm": 1.0, "loss": 0.0} for k in range(1, 4)),
    ])
    assert curves.main([str(tmp_path), "--window", "2"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert rows == [
        "| 0 | 1–2 | async-rl | 0.150 | 10.0 | 0.50 | 2.00 | 0.500 at 2 |",
        "| 0 | 1–2 | trl | 0.200 | 6.0 | 0.00 | 1.00 |  |",
        "| 0 | 3–4 | async-rl | 0.350 | 10.0 | 0.50 | 2.00 |  |",
        "| 0 | 3–4 | trl | 0.200 | 12.0 | 0.00 | 1.00 |  |",
    ]


def test_a_directory_without_runs_is_one_line_and_exit_2(tmp_path, capsys):
    assert curves.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
