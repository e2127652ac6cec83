"""launch/slurm.sbatch under a real Slurm: a controller (slurmctld), a node daemon
(slurmd) and munge, started here with their own configuration, key, ports and state in
a temporary directory; the job runs the learner and actor steps on this one node.
Skipped, with the reason, where Slurm is not installed (Debian: slurmctld slurmd
slurm-client munge) or its daemons cannot start (they need root)."""
import os
import shutil
import socket
import subprocess
import time

import pytest
from conftest import ROOT, read_metrics, subprocess_env

from async_rl.run_dir import RunDir

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(d, host: str) -> str:
    return f"""ClusterName=asyncrltest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
NodeName={host} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}; Debian: slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        pytest.skip("the Slurm daemons of this test run as root")
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    (d / "munge.key").write_bytes(os.urandom(1024))
    (d / "munge.key").chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(_config(d, host))
    env = dict(os.environ, SLURM_CONF=str(conf))
    subprocess.run(["munged", "--force", f"--socket={d}/munge.sock", f"--key-file={d}/munge.key",
                    f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
                   check=True, capture_output=True, timeout=30)
    daemons = [subprocess.Popen([name, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT) for name in ("slurmctld", "slurmd")]
    try:
        deadline = time.time() + 30
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=10)
            if state.stdout.strip() == "idle":
                break
            if time.time() > deadline or any(p.poll() is not None for p in daemons):
                logs = "".join((d / f"{n}.log").read_text()[-300:] for n in ("slurmctld", "slurmd")
                               if (d / f"{n}.log").exists())
                pytest.skip(f"the local Slurm did not start: {state.stderr.strip() or state.stdout.strip()} {logs}")
            time.sleep(0.5)
        yield env
    finally:
        for p in daemons:
            p.terminate()
        for p in daemons:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        pid = d / "munged.pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text().strip()), 15)
            except (ProcessLookupError, ValueError):
                pass


@pytest.mark.extended
def test_the_sbatch_script_runs_a_learner_and_its_actors_as_one_job(slurm, tmp_path, demo_model):
    run = tmp_path / "run"
    out = tmp_path / "job.out"
    env = subprocess_env(**slurm, RUN_DIR=str(run))
    proc = subprocess.run(["sbatch", "--wait", "--nodes=1", f"--cpus-per-task={os.cpu_count()}", f"--output={out}",
                           str(ROOT / "launch/slurm.sbatch"), str(ROOT / "configs/demo.yaml"),
                           f"model.path={demo_model}", "train.max_steps=8", "eval.every=0", "checkpoint.every=0"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    log = out.read_text() if out.exists() else ""
    assert proc.returncode == 0, (proc.stderr + log)[-3000:]
    assert "slurm.sbatch: hub tcp://" in log and "learner.sh: run directory" in log, log[-3000:]
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == list(range(1, 9)) and steps[-1]["actors/live"] == 1
    assert RunDir(run).status()["exit_code"] == 0
    assert "leaving: run finished" in log


def test_the_sbatch_script_refuses_more_learner_nodes_than_allocated(slurm, tmp_path):
    out = tmp_path / "job.out"
    proc = subprocess.run(["sbatch", "--wait", "--nodes=1", f"--output={out}", str(ROOT / "launch/slurm.sbatch"),
                           str(ROOT / "configs/demo.yaml")],
                          env=subprocess_env(**slurm, LEARNER_NODES="2", RUN_DIR=str(tmp_path / "run")), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "LEARNER_NODES=2 but the allocation has 1 node(s)" in out.read_text()
