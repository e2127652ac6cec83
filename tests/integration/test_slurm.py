"""launch/slurm.sbatch under a real Slurm: a controller (slurmctld), node daemons (slurmd)
and munge, started here with their own configuration, key, ports and state in a
temporary directory. On this one node, the job runs the learner and actor steps side by
side; on a bed of three nodes (network namespaces, benchmarks/netns_bed.py), one slurmd
per node, the learner spans two nodes and the actors run on the third, as one
allocation or as a heterogeneous job. Skipped, with the reason, where Slurm is not
installed (Debian: slurmctld slurmd slurm-client munge), its daemons cannot start (they
need root) or the machine refuses network namespaces."""
import contextlib
import os
import re
import shutil
import socket
import subprocess
import time

import pytest
from conftest import ROOT, load_script, read_metrics, subprocess_env

from async_rl.run.directory import RunDir

netns_bed = load_script("netns_bed")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(d, controller: str, nodes: dict[str, str]) -> str:
    """slurm.conf for `nodes` (name -> address); `controller` as SlurmctldHost takes it."""
    node_lines = "".join(f"NodeName={name} NodeAddr={addr} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN\n"
                         for name, addr in nodes.items())
    return f"""ClusterName=asyncrltest
SlurmctldHost={controller}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
{node_lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _skip_unless_slurm() -> None:
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}; "
                    "Debian: slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        pytest.skip("the Slurm daemons of this test run as root")


@contextlib.contextmanager
def _local_slurm(d, controller: str, nodes: dict[str, str], on_node=lambda node: []):
    """munge, slurmctld and one slurmd per node; `on_node(node)`: the command prefix that
    puts a daemon on that node (slurmctld runs on the first). Yields the environment
    that points Slurm's commands at this cluster."""
    (d / "state").mkdir()
    (d / "spool").mkdir()
    (d / "munge.key").write_bytes(os.urandom(1024))
    (d / "munge.key").chmod(0o600)
    conf = d / "slurm.conf"
    conf.write_text(_config(d, controller, nodes))
    env = dict(os.environ, SLURM_CONF=str(conf))
    subprocess.run(["munged", "--force", f"--socket={d}/munge.sock", f"--key-file={d}/munge.key",
                    f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
                   check=True, capture_output=True, timeout=30)
    first = next(iter(nodes))
    daemons = [subprocess.Popen([*on_node(first), "slurmctld", "-D", "-f", str(conf)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)]
    daemons += [subprocess.Popen([*on_node(node), "slurmd", "-D", "-N", node, "-f", str(conf)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for node in nodes]
    try:
        deadline = time.time() + 30
        while True:
            state = subprocess.run([*on_node(first), "sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True,
                                   text=True, timeout=10)
            if state.stdout.split() == ["idle"] * len(nodes):
                break
            if time.time() > deadline or any(p.poll() is not None for p in daemons):
                logs = " ".join(log.read_text()[-300:] for log in sorted(d.glob("slurm*.log")))
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


def _run_job(args: list[str], env: dict, out, timeout: float, prefix: tuple[str, ...] = ()) -> tuple[int, str]:
    """sbatch ARGS, then wait for the job's end; returns its exit code and output file.
    Polled here: `sbatch --wait` checks back at growing intervals, tens of seconds late."""
    sub = subprocess.run([*prefix, "sbatch", "--parsable", f"--output={out}", *args], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    deadline = time.time() + timeout
    while True:
        show = subprocess.run([*prefix, "scontrol", "-o", "show", "job", job], env=env, capture_output=True,
                              text=True, timeout=10).stdout
        state = (re.search(r"JobState=(\S+)", show) or [None, "?"])[1]
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "?"):
            break
        assert time.time() < deadline, f"job {job} still {state} after {timeout} s"
        time.sleep(0.5)
    code = int(re.search(r"ExitCode=(\d+):", show)[1])
    return code, out.read_text() if out.exists() else ""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    _skip_unless_slurm()
    host = socket.gethostname().split(".")[0]
    with _local_slurm(tmp_path_factory.mktemp("slurm"), host, {host: "127.0.0.1"}) as env:
        yield env


@pytest.fixture(scope="module")
def slurm_bed(tmp_path_factory):
    """Three nodes, each its own network namespace with a slurmd; the controller on the
    first. The daemons enter only the node's network namespace (nsenter): `ip netns exec`
    would also remount /sys, hiding the cgroup tree slurmd reads at start."""
    _skip_unless_slurm()
    reason = netns_bed.Bed.unavailable()
    if reason:
        pytest.skip(reason)
    if shutil.which("nsenter") is None:
        pytest.skip("`nsenter` (util-linux) is not installed")
    names = ["slurm0", "slurm1", "slurm2"]
    with netns_bed.Bed(names) as bed:
        host = socket.gethostname().split(".")[0]
        # The controller is known by this host's name (slurmctld checks it) at node 0's address.
        with _local_slurm(tmp_path_factory.mktemp("slurm-bed"), f"{host}({bed.address(names[0])})",
                          {name: bed.address(name) for name in names},
                          on_node=lambda node: ["nsenter", f"--net=/run/netns/{bed.namespace(node)}"]) as env:
            yield bed, env


@pytest.mark.extended
def test_the_sbatch_script_runs_a_learner_and_its_actors_as_one_job(slurm, tmp_path, demo_model):
    run = tmp_path / "run"
    out = tmp_path / "job.out"
    env = subprocess_env(**slurm, RUN_DIR=str(run))
    code, log = _run_job(["--nodes=1", f"--cpus-per-task={os.cpu_count()}", str(ROOT / "launch/slurm.sbatch"),
                          str(ROOT / "configs/demo.yaml"), f"model.path={demo_model}", "train.max_steps=8",
                          "eval.every=0", "checkpoint.every=0"], env, out, timeout=180)
    assert code == 0, log[-3000:]
    assert "slurm.sbatch: hub tcp://" in log and "learner.sh: run directory" in log, log[-3000:]
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == list(range(1, 9)) and steps[-1]["actors/live"] == 1
    assert RunDir(run).status()["exit_code"] == 0
    assert "leaving: run finished" in log


def test_the_sbatch_script_refuses_more_learner_nodes_than_allocated(slurm, tmp_path):
    out = tmp_path / "job.out"
    code, log = _run_job(["--nodes=1", str(ROOT / "launch/slurm.sbatch"), str(ROOT / "configs/demo.yaml")],
                         subprocess_env(**slurm, LEARNER_NODES="2", RUN_DIR=str(tmp_path / "run")), out, timeout=60)
    assert code == 2
    assert "LEARNER_NODES=2 but the learner's allocation has 1 node(s)" in log


def _sbatch_on_bed(bed, env, tmp_path, shape: list[str], demo_model) -> tuple[str, object]:
    run, out = tmp_path / "run", tmp_path / "job.out"
    # sbatch, and with it the batch script, on node 0, where the controller is.
    code, log = _run_job([*shape, str(ROOT / "launch/slurm.sbatch"), str(ROOT / "configs/demo.yaml"),
                          f"model.path={demo_model}", "train.max_steps=10", "eval.every=0", "checkpoint.every=0"],
                         subprocess_env(**env, RUN_DIR=str(run), IFNAME="eth0", NUM_ACTORS="2",
                                        RDZV_ID=f"bed-{time.monotonic_ns()}"),
                         out, timeout=240, prefix=("nsenter", f"--net=/run/netns/{bed.namespace('slurm0')}"))
    assert code == 0, log[-3000:]
    return log, run


def _trained_across_the_bed(bed, run, log: str) -> None:
    head = bed.address("slurm0")
    assert f"slurm.sbatch: hub tcp://{head}:" in log, log[-3000:]
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == list(range(1, 11))
    assert max(s["actors/live"] for s in steps) == 2
    assert RunDir(run).config()["learner"]["ranks"] == 2
    assert RunDir(run).endpoints()["store"].startswith(f"{head}:")
    assert RunDir(run).status()["exit_code"] == 0
    assert "learner.sh: node 1 waiting for node 0" in log, log[-3000:]


@pytest.mark.extended
def test_the_sbatch_script_spans_learner_nodes_and_an_actor_node(slurm_bed, tmp_path, demo_model):
    bed, env = slurm_bed
    log, run = _sbatch_on_bed(bed, {**env, "LEARNER_NODES": "2"}, tmp_path, ["--nodes=3"], demo_model)
    assert "actors on 1 node(s) from node 2" in log, log[-3000:]
    _trained_across_the_bed(bed, run, log)


@pytest.mark.extended
def test_the_sbatch_script_runs_as_a_heterogeneous_job(slurm_bed, tmp_path, demo_model):
    bed, env = slurm_bed
    log, run = _sbatch_on_bed(bed, env, tmp_path, ["--nodes=2", ":", "--nodes=1"], demo_model)
    assert "actors on component 1 (1 node(s))" in log, log[-3000:]
    _trained_across_the_bed(bed, run, log)
