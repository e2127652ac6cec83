"""`async-rl prepare` (and so `train`) checks the task and the user's reward before
anything is spawned: every failure is one line and exit status 2."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT, subprocess_env

from async_rl.cli import main
from async_rl.run.directory import RunDir


def prepare(tmp_path, model, *overrides):
    return main(["prepare", str(ROOT / "configs/demo.yaml"), f"run_dir={tmp_path / 'run'}", f"model.path={model}",
                 *overrides])


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("async-rl: config error: ")
    return err[0]


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{a}+3=", "answer": str(a + 3)} for a in range(10, 40)])


def test_a_good_task_prepares(tmp_path, demo_model, data, capsys):
    assert prepare(tmp_path, demo_model, "task.name=jsonl", f"task.train_path={data}", "task.reward=last_number") == 0
    assert (tmp_path / "run" / "config.yaml").exists()


def test_the_first_bad_jsonl_line_is_named(tmp_path, demo_model, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 3 + ['{"prompt": "x"}'])
    assert prepare(tmp_path, demo_model, "task.name=jsonl", f"task.train_path={bad}", "task.reward=last_number") == 2
    assert f"{bad}:4: no 'answer' (the answer the reward compares with)" in one_line_error(capsys)


@pytest.mark.parametrize(("code", "needle"), [
    (None, "no module named 'rewards_nowhere'; it must be importable from the working directory"),
    ("def score(p, r, a):\n    raise KeyError('answer')\n", "raised KeyError: 'answer' on a sample"),
    ("def score(p, r, a):\n    return None\n", "returned None on a sample; a reward must be a finite number"),
    ("def score(p, r, a):\n    return 'yes'\n", "returned 'yes' on a sample"),
    ("def score(p, r, a):\n    return float('nan')\n", "returned nan on a sample"),
    ("import nowhere_xyz\n", "failed to import (ModuleNotFoundError"),
])
def test_reward_faults_fail_before_launch(tmp_path, demo_model, data, capsys, monkeypatch, code, needle):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = "rewards_nowhere" if code is None else f"rewards_{abs(hash(code))}"
    if code is not None:
        (tmp_path / f"{module}.py").write_text(code)
    assert prepare(tmp_path, demo_model, "task.name=jsonl", f"task.train_path={data}",
                   f"task.reward={module}:score") == 2
    assert needle in one_line_error(capsys)


def test_a_reward_file_path_is_made_absolute(tmp_path, demo_model, data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text("def score(p, r, a):\n    return 1\n")
    assert prepare(tmp_path, demo_model, "task.name=jsonl", f"task.train_path={data}",
                   "task.reward=my_rewards.py:score") == 0
    assert f"reward: {tmp_path / 'my_rewards.py'}:score" in (tmp_path / "run" / "config.yaml").read_text()


def test_conversations_need_a_chat_template(tmp_path, chat_model, capsys):
    rows = write_jsonl(tmp_path / "chat.jsonl",
                       [{"messages": [{"role": "user", "content": f"{a} + 1?"}], "answer": str(a + 1)}
                        for a in range(20)])
    args = ["task.name=jsonl", f"task.train_path={rows}", "task.reward=last_number"]
    assert prepare(tmp_path, chat_model, *args, "task.chat_template=false") == 2
    assert "is a conversation (`messages`), but no chat template is used" in one_line_error(capsys)
    assert prepare(tmp_path / "b", chat_model, *args, "task.chat_template=true") == 0


def test_train_exits_2_in_one_line_without_spawning(tmp_path, demo_model, data):
    """The whole command, as a user runs it: no torchrun output, status 2."""
    proc = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"),
                           f"run_dir={tmp_path / 'run'}", f"model.path={demo_model}", "task.name=jsonl",
                           f"task.train_path={data}", "task.reward=missing_rewards_module:score"],
                          capture_output=True, text=True, timeout=120, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no module named 'missing_rewards_module'" in lines[0]


def test_a_reward_module_in_the_working_directory_reaches_the_spawned_processes(tmp_path, demo_model, data):
    """`task.reward: my_rewards:score` with my_rewards.py next to where `train` runs: the
    learner and the actor import it too (the launcher puts the directory on their path)."""
    (tmp_path / "my_rewards.py").write_text("def score(prompt, response, answer):\n"
                                            "    return float(response.strip() == answer)\n")
    # Run as the installed `async-rl` script runs: its path starts at the script's own
    # directory, not at the working directory (`python -m` would hide that difference).
    script = tmp_path / "bin" / "async-rl"
    script.parent.mkdir()
    script.write_text("import sys\nfrom async_rl.cli import main\nsys.exit(main())\n")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), "train", str(ROOT / "configs/demo.yaml"),
                           f"run_dir={run}", f"model.path={demo_model}", "task.name=jsonl",
                           f"task.train_path={data}", "task.reward=my_rewards:score", "learner.ranks=1",
                           "train.max_steps=2", "train.batch_groups=4", "train.group_size=2",
                           "actors.groups_per_request=4", "eval.size=8"],
                          capture_output=True, text=True, timeout=180, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps, evals = RunDir(run).steps_and_evals(strict=True)
    assert len(steps) == 2 and len(evals) >= 1


def test_learner_ranks_auto_is_one_on_cpu_one_per_gpu_and_must_divide_the_batch(monkeypatch):
    import torch

    import async_rl.run.launcher as launcher
    from async_rl.config import ConfigError, load_config

    cfg = load_config(ROOT / "configs/demo.yaml", ["model.device=cpu"])
    assert cfg.learner.ranks == "auto"
    assert launcher.choose_learner_ranks(cfg).startswith("learner.ranks=auto: 1 (CPU") and cfg.learner.ranks == 1
    explicit = load_config(ROOT / "configs/demo.yaml", ["learner.ranks=2"])
    assert launcher.choose_learner_ranks(explicit) is None and explicit.learner.ranks == 2

    monkeypatch.setattr(launcher, "device_type", lambda name: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    gpus = load_config(ROOT / "configs/demo.yaml")
    assert "one per visible GPU (4)" in launcher.choose_learner_ranks(gpus) and gpus.learner.ranks == 4
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(ConfigError, match=r"^learner.ranks: auto chose 3, but train.batch_groups: must be a multiple"):
        launcher.choose_learner_ranks(load_config(ROOT / "configs/demo.yaml"))


def test_vllm_actors_without_vllm_fail_before_launch(tmp_path, demo_model, capsys):
    from conftest import vllm_missing

    if not vllm_missing():
        pytest.skip("vLLM is installed here (the vLLM job runs the next test instead)")
    assert prepare(tmp_path, demo_model, "actors.engine=vllm") == 2
    assert "actors.engine=vllm needs vLLM >= 0.32, which is not installed (CPU: pip install" in one_line_error(capsys)


@pytest.mark.vllm
def test_vllm_actors_on_a_model_vllm_cannot_run_fail_before_launch(tmp_path, demo_model, capsys):
    """The demo model for torch actors: 16-wide heads, which vLLM's CPU attention lacks."""
    assert prepare(tmp_path, demo_model, "actors.engine=vllm", "model.device=cpu") == 2
    assert "model.path: head size 16 is not one vLLM's CPU attention implements" in one_line_error(capsys)


def test_a_row_task_without_reward_or_environment_and_a_missing_column_are_one_line(tmp_path, demo_model, data,
                                                                                  capsys):
    assert prepare(tmp_path, demo_model, "task.name=jsonl", f"task.train_path={data}") == 2
    assert "task.reward: a jsonl task needs a reward, unless an environment (env.name, not the calculator)" in \
        one_line_error(capsys)
    assert prepare(tmp_path, demo_model, "task.name=jsonl", f"task.train_path={data}", "env.name=calculator") == 2
    assert "task.reward: a jsonl task needs a reward" in one_line_error(capsys)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"q": f"{a}+3=", "a": str(a + 3)} for a in range(20)]).to_parquet(
        str(tmp_path / "rows.parquet"))
    capsys.readouterr()  # the writer's progress bar
    assert prepare(tmp_path, demo_model, "task.name=dataset", f"task.path={tmp_path / 'rows.parquet'}",
                   "task.prompt_column=question", "task.reward=last_number") == 2
    assert "no column 'question' (task.prompt_column); it has a, q" in one_line_error(capsys)
    assert prepare(tmp_path, demo_model, "task.name=dataset", "task.path=rows.parquet", "task.prompt_column=q",
                   "task.answer_column=a", "task.reward=last_number") == 2  # relative to the working directory
    assert "rows.parquet: no such file or folder" in one_line_error(capsys)
