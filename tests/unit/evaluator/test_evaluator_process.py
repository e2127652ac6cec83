import time

import pytest

from async_rl.evaluator.process import MAX_RESTARTS, EvaluatorProcess


def wait_exit(process: EvaluatorProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while process.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def test_an_evaluator_that_keeps_failing_is_restarted_then_given_up(tmp_path):
    process = EvaluatorProcess(tmp_path / "missing", tmp_path / "logs" / "evaluator.log", threads=1)
    process.start()
    notes = []
    for _ in range(MAX_RESTARTS + 1):
        wait_exit(process)
        notes.append(process.watch())
    for k, note in enumerate(notes[:-1], start=1):
        assert note.startswith(f"the evaluator exited with status 1; restarted it ({k} of {MAX_RESTARTS}; its log:")
    assert notes[-1].startswith("the evaluator exited with status 1; not restarting it after 3 restarts")
    assert process.given_up and process.watch() is None
    assert "FileNotFoundError" in (tmp_path / "logs" / "evaluator.log").read_text()  # the cause, in its log


def test_the_evaluator_lowers_its_autogroup_too(tmp_path):
    """In a session of its own (as the learner starts it), a task's nice alone would not
    weigh against training where the kernel groups sessions: the group's nice must."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import os; from async_rl.evaluator.service import lower_priority; lower_priority(19); "
            "group = '/proc/self/autogroup'; print(os.nice(0)); "
            "print(open(group).read().strip() if os.path.exists(group) else 'no autogroup nice 19')")
    out = subprocess.run([sys.executable, "-c", code], start_new_session=True, capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3])))
    assert out.returncode == 0, out.stderr
    niceness, group = out.stdout.splitlines()
    assert niceness == "19" and group.endswith("nice 19")


SLOW_IMPORT = """import time
from pathlib import Path

Path({importing!r}).touch()
time.sleep(4)
Path({imported!r}).touch()


def score(prompt, response, answer):
    return 0.0
"""


@pytest.mark.integration  # a real evaluator's start: model, engine, a reward module that takes 4 s
def test_a_starting_evaluator_is_progress_for_the_learner(tmp_path, demo_model):
    """While the evaluator loads (here a reward module that takes 4 s to import), its
    progress mark stays fresh: the learner's final wait does not give up on it."""
    from pathlib import Path

    import torch

    from async_rl.config import load_config, to_yaml
    from async_rl.evaluator.versions import PROGRESS_FILE, VersionStore

    importing, imported = tmp_path / "importing", tmp_path / "imported"
    reward = tmp_path / "slow_import.py"
    reward.write_text(SLOW_IMPORT.format(importing=str(importing), imported=str(imported)))
    root = Path(__file__).resolve().parents[3]
    cfg = load_config(root / "configs/demo.yaml", [f"model.path={demo_model}", f"task.reward={reward}:score",
                                                   "eval.size=4"])
    folder = tmp_path / "evaluator"
    VersionStore(folder, to_yaml(cfg), torch.float32)
    process = EvaluatorProcess(folder, tmp_path / "logs" / "evaluator.log", threads=1)
    process.start()
    marks = set()
    try:
        deadline = time.monotonic() + 120
        while not imported.exists() and process.proc.poll() is None and time.monotonic() < deadline:
            marks.add((folder / PROGRESS_FILE).stat().st_mtime)
            time.sleep(0.05)
        assert imported.exists(), (tmp_path / "logs" / "evaluator.log").read_text()
    finally:
        process.stop()
    assert any(importing.stat().st_mtime < mark < imported.stat().st_mtime for mark in marks)
