"""benchmarks/bench_reward_server.py and benchmarks/rm_vs_task.py: their arithmetic, and that
each starts as a script."""
import json
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_reward_server import read_rows  # noqa: E402
from rm_vs_task import windows  # noqa: E402


def test_pairs_give_both_sides_as_rows(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": f"c{i}", "rejected": f"r{i}"}) + "\n"
                             for i in range(3)))
    assert read_rows(pairs, 5) == [("q0", "c0"), ("q0", "r0"), ("q1", "c1"), ("q1", "r1"), ("q2", "c2")]


def test_windows_are_means_of_consecutive_steps():
    steps = [{"r": v} for v in (1.0, 2.0, 3.0, 4.0, 5.0)] + [{"other": 1.0}]
    assert windows(steps, "r", 2) == [1.5, 3.5, 5.0]


def test_both_start_as_scripts():
    for script in ("bench_reward_server.py", "rm_vs_task.py"):
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0 and "usage" in done.stdout, done.stderr
