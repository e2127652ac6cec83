import time

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
