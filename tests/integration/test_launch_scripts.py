"""launch/learner.sh (torchrun with c10d rendezvous, 2 ranks, one node on loopback) and
launch/actors.sh (1 actor) as real processes: a few steps, clean exits, no orphans."""
import socket
import subprocess
import time

from conftest import ROOT, kill_tree, read_metrics, subprocess_env, survivors

from async_rl.run.directory import RunDir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> set[int]:
    from async_rl.run.processes import process_tree

    return set(process_tree(pid)[1:])


def test_learner_and_actor_scripts_train_a_few_steps(tmp_path, demo_model):
    run = tmp_path / "run"
    store_port = _free_port()  # a fixed weight-sync store port, as a firewall needs
    env = subprocess_env(NNODES="1", NODE_RANK="0", NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(_free_port()), RDZV_ID="test-launch", RUN_DIR=str(run),
                         STORE_PORT=str(store_port))
    learner = subprocess.Popen(
        ["bash", str(ROOT / "launch/learner.sh"), str(ROOT / "configs/demo.yaml"), f"model.path={demo_model}",
         "train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4", "task.eval_size=32",
         "eval.every=0", "train.max_steps=3"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    actors = None
    seen: set[int] = set()
    try:
        deadline = time.time() + 60
        while (endpoints := RunDir(run).endpoints()) is None:
            assert learner.poll() is None, learner.stdout.read()[-3000:]
            assert time.time() < deadline, "no endpoints.json within 60 s"
            time.sleep(0.1)
        assert endpoints["hub"].startswith("tcp://127.0.0.1:")
        assert endpoints["store"] == f"127.0.0.1:{store_port}"
        seen |= _descendants(learner.pid)
        actors = subprocess.Popen(["bash", str(ROOT / "launch/actors.sh")],
                                  env=subprocess_env(HUB=endpoints["hub"], NUM_ACTORS="1", NAME_PREFIX="test"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while learner.poll() is None and time.time() < deadline + 60:
            seen |= _descendants(learner.pid) | _descendants(actors.pid)
            time.sleep(0.2)
        out, _ = learner.communicate(timeout=30)
        actor_out, _ = actors.communicate(timeout=45)  # the hub says goodbye when the learner stops
    finally:
        for proc in (learner, actors):
            if proc is not None and proc.poll() is None:
                kill_tree(proc)
    assert learner.returncode == 0, out[-3000:]
    assert "learner.sh: hub tcp://127.0.0.1:" in out and "launch/actors.sh" in out
    assert "async-rl: steps" in out  # the end-of-run summary, as after `async-rl train`
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[-1]["actors/live"] == 1
    assert RunDir(run).config()["learner"]["ranks"] == 2
    assert RunDir(run).status()["exit_code"] == 0
    assert (run / "final" / "config.json").exists()
    assert actors.returncode == 0, actor_out[-3000:]
    assert "(test-0)" in actor_out and "leaving" in actor_out
    assert len(seen) >= 4  # torchrun, 2 learner ranks, the actor
    assert not survivors(seen), "orphan processes left behind"


def test_learner_script_propagates_a_config_error(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "launch/learner.sh"), str(ROOT / "configs/demo.yaml"),
                           "train.batchgroups=8"], env=subprocess_env(RUN_DIR=str(tmp_path / "r")),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "train.batchgroups: unknown key" in proc.stderr


def test_learner_script_exits_with_the_status_the_learner_recorded(tmp_path, demo_model):
    """The learner exits 0 and records why it stopped in status.json (e.g. 3: too many
    non-finite steps); learner.sh exits with that, as `async-rl train` does. The learner world is
    replaced by a stub that only writes status.json."""
    import sys

    stub = tmp_path / "python"
    stub.write_text(f"""#!/usr/bin/env bash
if [[ $1 == -m && $2 == async_rl.learner.world ]]; then
    echo '{{"exit_code": 3, "reason": "stopped: 3 non-finite steps"}}' >"$(dirname "${{@: -1}}")/status.json"
    exit 0
fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    run = tmp_path / "run"
    proc = subprocess.run(["bash", str(ROOT / "launch/learner.sh"), str(ROOT / "configs/demo.yaml"),
                           f"model.path={demo_model}", "train.batch_groups=8"],
                          env=subprocess_env(RUN_DIR=str(run), PYTHON=str(stub), MASTER_PORT=str(_free_port())),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "learner.sh: stopped: 3 non-finite steps" in proc.stderr
    assert RunDir(run).config_path.exists()
