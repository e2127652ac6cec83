"""A user's environment that fails, end to end: the stop names the environment (not the
reward), with the counts per reason and the first failure's message, on the console
and in status.json; a stopped run evaluates nothing more; an environment that floods
its episodes with text has its answers cut, counted and named once."""
import json
import subprocess
import sys

from conftest import ROOT, read_metrics, subprocess_env, train

ENV = '''
import time

from async_rl.actor.environments import Turn


class Flooding:
    """Answers the first turn with 200,000 characters, then ends the episode."""

    def __init__(self, prompt):
        self.turns = 0

    def step(self, action):
        self.turns += 1
        if self.turns == 1:
            return Turn([{"role": "user", "content": "x" * 200_000}], reward=0.5)
        return Turn(reward=1.0, done=True)


class Done:
    def step(self, action):
        return Turn(reward=0.0, done=True)


# Broken from the start of an episode: the random model's turns seldom end with a stop
# token, so few would reach a broken step() (the unit tests break step() itself). The
# first environment of each process is whole, as the launch check's is.
_made = [0]


def raising(prompt):
    _made[0] += 1
    if _made[0] > 1:
        raise RuntimeError("the board is gone")
    return Done()


def hanging(prompt):
    _made[0] += 1
    if _made[0] > 1:
        time.sleep(600)
    return Done()


def flooding(prompt):
    return Flooding(prompt)
'''

# The random model samples "e" often: it ends a turn (actors.stop), so its turns reach the environment.
MULTI_TURN = ["task.name=word_problems", "env.max_turns=3", "env.max_tokens=40", "actors.max_new_tokens=6",
              "actors.stop=[e]", "learner.ranks=1", "eval.size=8", "eval.batch_size=8"]


def _broken_run(tmp_path, chat_model, factory: str, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    (tmp_path / "envs.py").write_text(ENV)
    name = f"{tmp_path / 'envs.py'}:{factory}"
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={tmp_path / 'r'}",
           f"model.path={chat_model}", "train.batch_groups=4", "train.group_size=4", "actors.groups_per_request=4",
           "train.max_steps=5", "eval.every=0", f"env.name={name}", *MULTI_TURN, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=subprocess_env()), name


def _stop_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if "stopped:" in line]
    assert proc.returncode == 4 and lines, proc.stderr[-3000:]
    assert all(line.startswith("async-rl: stopped:") or " async_rl.learner" in line for line in lines), lines
    return next(line for line in lines if line.startswith("async-rl: stopped:"))


def test_an_environment_that_raises_stops_the_run_with_a_line_naming_it(tmp_path, chat_model):
    proc, name = _broken_run(tmp_path, chat_model, "raising")
    line = _stop_line(proc)
    assert f"failed in environment {name} (raised " in line and "fix the environment" in line, line
    assert "first: environment raised RuntimeError: the board is gone" in line and "task.reward" not in line, line
    status = json.loads((tmp_path / "r" / "status.json").read_text())
    assert status["exit_code"] == 4 and status["reason"] == line.removeprefix("async-rl: ")
    steps, evals = read_metrics(tmp_path / "r")
    assert len(steps) == 1 and steps[0]["env/errors_raised"] > 0 and steps[0]["reward/errors"] == 0
    assert all(e["step"] == 0 for e in evals)  # no final evaluation of a run stopped by broken code


def test_an_environment_that_hangs_fails_by_timeout_and_the_run_ends_without_evaluating(tmp_path, chat_model):
    proc, name = _broken_run(tmp_path, chat_model, "hanging", "env.timeout_s=2", "eval.size=4", "eval.batch_size=4")
    line = _stop_line(proc)
    assert f"failed in environment {name} (raised 0, timeout " in line and "ran past its timeout of 2s" in line, line
    steps, evals = read_metrics(tmp_path / "r")
    assert len(steps) == 1 and all(e["step"] == 0 for e in evals)


def test_an_environment_that_floods_its_episodes_is_cut_counted_and_named_once(tmp_path, chat_model):
    (tmp_path / "envs.py").write_text(ENV)
    name = f"{tmp_path / 'envs.py'}:flooding"
    run = tmp_path / "run"
    proc = train(run, chat_model, f"env.name={name}", *MULTI_TURN, "train.max_steps=3")
    steps, evals = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2, 3] and sum(s["env/observations_cut"] for s in steps) > 0
    assert all(s["env/errors"] == 0 and s["reward/errors"] == 0 for s in steps)
    warnings = [line for line in proc.stderr.splitlines() if "env/observations_cut" in line and name in line]
    assert len(warnings) == 1 and "env.max_tokens=40" in warnings[0], proc.stderr[-3000:]
    assert "episodes ended truncated by an environment answer" in proc.stderr
