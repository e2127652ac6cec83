"""benchmarks/staleness_sweep.py: its CLI, a tiny real sweep (4 runs of 2 steps), resuming it, and --report-only.

A tiny run still costs ~12-20 s of process startup on 2 cores, so the 2 x 2 sweep is
made in two tests of 2 runs each: the second repeats the full command on the same
directory, which must skip the first test's finished runs (run alone, it does all 4).
"""
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/staleness_sweep.py"
TINY = ["--set", "train.batch_groups=8", "--set", "train.group_size=4", "--set", "actors.groups_per_request=4",
        "--set", "task.eval_size=32", "--set", "eval.every=1", "--set", "learner.ranks=1", "--target", "0.0",
        "--steps", "2", "--staleness", "0", "2"]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("sweep") / "out"


def sweep(*args: str, timeout: int = 100) -> subprocess.CompletedProcess:
    # Own process group: on a timeout, Ctrl-C reaches the sweep and its current
    # launcher, which then stops its learner and actors (a kill would orphan them).
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=subprocess_env(), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"sweep took over {timeout} s:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_help_works_and_names_max_staleness():
    proc = sweep("--help", timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "max_staleness" in proc.stdout


@pytest.mark.extended
def test_tiny_sweep_one_loss(out, demo_model):
    proc = sweep("--model", str(demo_model), "--losses", "naive", *TINY, "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ["naive-s0", "naive-s2"]:
        assert (out / name / "metrics.jsonl").exists() and (out / name / "final").is_dir(), name
        assert f"{name}: " in proc.stdout and "final accuracy" in proc.stdout  # one progress line per run
    assert not (out / "base_model").exists()  # --model given: nothing built
    assert table_rows((out / "sweep.md").read_text())[0] == "| max_staleness | naive | mean staleness |"


@pytest.mark.extended
def test_tiny_sweep_resumes_then_report_only(out, demo_model):
    finished_before = {n for n in ["naive-s0", "naive-s2"] if (out / n / "final").is_dir()}
    proc = sweep("--model", str(demo_model), "--losses", "naive", "opmd", *TINY, "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = ["naive-s0", "opmd-s0", "naive-s2", "opmd-s2"]
    for name in names:
        assert (out / name / "metrics.jsonl").exists() and (out / name / "final").is_dir(), name
        skipped = f"{name}: already finished, skipped" in proc.stdout
        assert skipped == (name in finished_before), proc.stdout

    table = (out / "sweep.md").read_text()
    assert table in proc.stdout and "--steps 2" in table and "failed" not in table
    rows = table_rows(table)
    assert rows[0] == "| max_staleness | naive | opmd | mean staleness |"
    assert len(rows) == 4 and rows[2].startswith("| 0 | ") and rows[3].startswith("| 2 | ")
    # Target 0.0 is met at the first evaluation (step 0), so every cell reads "ACC · 0 steps · WALL s".
    assert rows[2].count(" · 0 steps · ") == 2 and rows[3].count(" · 0 steps · ") == 2
    assert rows[2].endswith("| 0.00 / 0.00 |")  # max_staleness 0 is on-policy
    png = out / "sweep.png"
    if HAVE_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000

    # --report-only rebuilds the same table from the run directories alone, running nothing.
    (out / "sweep.md").unlink()
    png.unlink(missing_ok=True)
    mtimes = {n: (out / n / "metrics.jsonl").stat().st_mtime_ns for n in names}
    again = sweep("--report-only", "--target", "0.0", "--out", str(out), timeout=30)
    assert again.returncode == 0, again.stderr
    assert again.stdout == table and (out / "sweep.md").read_text() == table
    assert png.exists() == HAVE_MATPLOTLIB
    assert mtimes == {n: (out / n / "metrics.jsonl").stat().st_mtime_ns for n in names}
