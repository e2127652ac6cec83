"""What `async-rl train` decides before it starts anything: the learner world's command
(one rank as the launcher's own child, several under torchrun), why a learner that left
no reason ended, and the demo model built once per machine and copied after."""
import subprocess
import sys

from async_rl.config import build_config
from async_rl.models.demo import INFO_FILE
from async_rl.run.demo_model import demo_cache, ensure_demo_model
from async_rl.run.launcher import killed_or_failed, learner_command


def test_one_rank_runs_without_torchrun_and_several_under_it(tmp_path):
    one = learner_command(build_config({"learner": {"ranks": 1}}), tmp_path, None)
    assert one[1:] == ["-m", "async_rl.learner", str(tmp_path / "config.yaml")]
    two = learner_command(build_config({"learner": {"ranks": 2}}), tmp_path, tmp_path / "checkpoints" / "step_000002")
    assert two[1:4] == ["-m", "async_rl.learner.world", str(tmp_path)] and "--nproc-per-node=2" in two
    assert two[-4:] == ["async_rl.learner", str(tmp_path / "config.yaml"), "--resume",
                        str(tmp_path / "checkpoints" / "step_000002")]


def test_a_learner_killed_by_a_signal_is_named_as_torchrun_names_it():
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    proc.wait(timeout=30)
    assert killed_or_failed(proc) == f"learner rank 0 (pid {proc.pid}) was killed by SIGKILL"
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(timeout=30)
    assert killed_or_failed(proc) == "exit status 3"


def test_the_demo_model_is_built_once_then_copied(tmp_path, monkeypatch):
    import async_rl.models.demo as demo

    build = demo.build_demo_model  # the real builder, without waiting for mixed groups (seconds, not 15)
    monkeypatch.setattr(demo, "build_demo_model", lambda *a, **kw: build(*a, **kw, min_mixed_fraction=0.0))
    monkeypatch.setenv("ASYNC_RL_CACHE", str(tmp_path / "cache"))
    cfg = build_config({"model": {"warm_start_accuracy": 0.0}, "task": {"eval_size": 16}})
    first = ensure_demo_model(cfg, tmp_path / "a")
    cached = demo_cache(cfg, {})
    assert (cached / INFO_FILE).exists() and not list(cached.parent.glob("*.partial"))
    def build_again(*args, **kwargs):
        raise AssertionError("built again instead of copied from the cache")

    monkeypatch.setattr(demo, "build_demo_model", build_again)
    second = ensure_demo_model(cfg, tmp_path / "b")
    for name in ("model.safetensors", "config.json", "tokenizer.json", INFO_FILE):
        assert (second / name).read_bytes() == (first / name).read_bytes(), name
    # Anything the build depends on is in the key; an empty ASYNC_RL_CACHE turns the cache off.
    assert demo_cache(build_config({"seed": 1, "model": {"warm_start_accuracy": 0.0}, "task": {"eval_size": 16}}),
                      {}) != cached
    assert demo_cache(cfg, {"head_dim": 32}) != cached
    monkeypatch.setenv("ASYNC_RL_CACHE", "")
    assert demo_cache(cfg, {}) is None
