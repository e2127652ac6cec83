"""vLLM actors for real (marked `vllm`: the vLLM job of .ci/run): actor processes each
holding a vLLM engine and its receiver, learner rank 0's broadcaster in this process,
gloo between them; then a whole `async-rl train` run with vLLM actors.

- an actor killed mid-broadcast (its process ends after two chunks): rank 0 counts the
  sync failed, the survivor is left not intact (vLLM received in place), and the retry
  to the survivors gives it the learner's weights;
- an actor joining later gets the current version in a new epoch;
- `async-rl train configs/demo.yaml actors.engine=vllm` learns.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
from conftest import ROOT, subprocess_env, wait_for_job
from transformers import AutoModelForCausalLM
from vllm_models import PROMPTS, learner_like, save_model

from async_rl.actor.engines.torch_engine import TorchEngine
from async_rl.run.directory import RunDir
from async_rl.weight_transfer.sender import WeightSender

pytestmark = pytest.mark.vllm

BUCKET_MB = 0.05  # the demo-sized model in about 14 chunks


def actor(model_dir: str, conn, die_after_chunks: int | None, corrupt_chunk: int | None = None) -> None:
    """A vLLM actor's weight side, driven over a pipe; with `die_after_chunks` its process
    is killed (SIGKILL, no clean-up) once that many chunks have arrived; with
    `corrupt_chunk`, that chunk of its first sync arrives with one bit flipped."""
    torch.set_num_threads(1)
    from async_rl.actor.engines import make_engine

    engine = make_engine("vllm", model_or_path=model_dir, device="cpu", kv_cache_gb=0.25)
    receiver = engine.weight_receiver(bucket_mb=BUCKET_MB, timeout_s=10)
    if die_after_chunks is not None or corrupt_chunk is not None:
        from async_rl.weight_transfer.vllm import gloo_plugin as vllm_gloo

        real, seen = vllm_gloo.broadcast, [0]

        def broadcast_with_fault(group, tensor):
            real(group, tensor)
            seen[0] += 1
            if seen[0] == die_after_chunks:
                os.kill(os.getpid(), signal.SIGKILL)
            if seen[0] == corrupt_chunk:
                tensor[7] ^= 0x01

        vllm_gloo.broadcast = broadcast_with_fault
    conn.send("ready")
    while True:
        command, *args = conn.recv()
        if command == "sync":
            version, epoch, rank, world, host, port = args
            try:
                receiver.receive(epoch=epoch, rank=rank, world_size=world, store_host=host, store_port=port,
                                 version=version)
                engine.set_version(version)
                conn.send(("ok", receiver.intact))
            except Exception as err:
                conn.send((f"failed: {err}", receiver.intact))
        elif command == "greedy":
            conn.send([g[0].tokens.tolist() for g in engine.generate(PROMPTS, max_new_tokens=10, greedy=True)])
        else:
            conn.close()
            os._exit(0)


class Actors:
    def __init__(self, model_dir: str, dying: dict[int, int], corrupting: dict[int, int] | None = None):
        ctx = mp.get_context("spawn")
        self.procs, self.conns = {}, {}
        for actor_id in (1, 2, 3):
            parent, child = ctx.Pipe()
            self.procs[actor_id] = ctx.Process(
                target=actor, args=(model_dir, child, dying.get(actor_id), (corrupting or {}).get(actor_id)),
                daemon=True)
            self.procs[actor_id].start()
            self.conns[actor_id] = parent
        for actor_id in self.conns:
            assert self.answer(actor_id, 90) == "ready"

    def answer(self, actor_id: int, timeout: float = 30):
        assert self.conns[actor_id].poll(timeout), f"actor {actor_id} did not answer"
        return self.conns[actor_id].recv()

    def sync(self, bc, job, actor_ids, version: int) -> dict[int, tuple]:
        for actor_id in actor_ids:
            self.conns[actor_id].send(("sync", version, job.epoch, job.rank_of(actor_id), len(job.members) + 1,
                                       bc.host, bc.port))
        return {actor_id: self.answer(actor_id) for actor_id in actor_ids}

    def greedy(self, actor_id: int):
        self.conns[actor_id].send(("greedy",))
        return self.answer(actor_id)

    def close(self) -> None:
        for actor_id, proc in self.procs.items():
            if proc.is_alive():
                try:
                    self.conns[actor_id].send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def learner_and_sender(tmp_path):
    """The actors' base model, a learner with other weights, the learner's greedy outputs
    (what a synced actor must answer) and rank 0's sender in vLLM's packed layout."""
    model_dir = save_model(tmp_path / "model", seed=0)
    learner = learner_like(model_dir, seed=1)
    want = [g[0].tokens.tolist() for g in TorchEngine(learner, device="cpu").generate(PROMPTS, max_new_tokens=10,
                                                                                       greedy=True)]
    specs = [(n, tuple(p.shape), p.dtype) for n, p in learner.named_parameters()]
    bc = WeightSender(specs, bucket_mb=BUCKET_MB, host="127.0.0.1", backend="gloo", device=torch.device("cpu"),
                      timeout_s=10, engine="vllm")
    return model_dir, learner, want, bc


def test_actor_killed_mid_broadcast_then_a_newcomer(tmp_path) -> None:
    model_dir, learner, want, bc = learner_and_sender(tmp_path)
    actors = Actors(model_dir, dying={1: 2})
    try:
        assert actors.greedy(2) != want
        bc.set_members([1, 2])
        bc.publish(1, iter(learner.named_parameters()))
        job = wait_for_job(bc, [1, 2])
        for actor_id in (1, 2):
            actors.conns[actor_id].send(("sync", 1, job.epoch, job.rank_of(actor_id), 3, bc.host, bc.port))
        survivor = actors.answer(2)
        actors.procs[1].join(timeout=10)
        assert actors.procs[1].exitcode == -signal.SIGKILL  # killed mid-broadcast
        deadline = time.time() + 20
        while bc.failures == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert bc.failures >= 1 and bc.completed == 0
        if survivor[0] != "ok":  # the broadcast broke off here too: vLLM holds two versions
            assert survivor == (survivor[0], False) and survivor[0].startswith("failed")
        # The hub reaps the dead actor; the retry goes to the survivor in a new epoch.
        bc.set_members([2])
        retry = wait_for_job(bc, [2], newer_than=job.epoch)
        assert retry.version == 1 and actors.sync(bc, retry, [2], 1) == {2: ("ok", True)}
        assert actors.greedy(2) == want
        # A newcomer (still on the base weights) gets the current version with the survivor.
        assert actors.greedy(3) != want
        bc.set_members([2, 3])
        joined = wait_for_job(bc, [2, 3], newer_than=retry.epoch)
        assert actors.sync(bc, joined, [2, 3], 1) == {2: ("ok", True), 3: ("ok", True)}
        assert actors.greedy(3) == want
        deadline = time.time() + 10
        while bc.completed < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert bc.completed == 2
    finally:
        actors.close()
        bc.close(wait_s=5)


def test_a_chunk_corrupted_in_flight_is_refused_and_sent_again(tmp_path) -> None:
    model_dir, learner, want, bc = learner_and_sender(tmp_path)
    actors = Actors(model_dir, dying={}, corrupting={1: 3})
    try:
        bc.set_members([1, 2])
        bc.publish(1, iter(learner.named_parameters()))
        job = wait_for_job(bc, [1, 2])
        answers = actors.sync(bc, job, [1, 2], 1)
        assert answers[2] == ("ok", True)
        message, intact = answers[1]
        names = [e.name for e in bc.plan[2].entries]  # the third chunk
        assert message.startswith(f"failed: version 1 did not arrive as sent: {names[0]} (bucket 2, bytes 0-")
        assert not intact  # vLLM loaded it in place: nothing is generated until a sync passes
        bc.resend(job.epoch)  # what the hub does when the actor reports it
        again = wait_for_job(bc, [1, 2], newer_than=job.epoch)
        assert actors.sync(bc, again, [1, 2], 1) == {1: ("ok", True), 2: ("ok", True)}
        assert actors.greedy(1) == want
    finally:
        actors.close()
        bc.close(wait_s=5)


def test_a_training_run_with_vllm_actors_learns(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", "configs/demo.yaml", "actors.engine=vllm",
                           "train.max_steps=60", "eval.every=30", "checkpoint.every=0", "sync.in_flight=true",
                           f"run_dir={run_dir}"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = RunDir(run_dir)
    steps, evals = run.steps_and_evals()
    assert len(steps) == 60 and max(s["staleness/max"] for s in steps) <= 1
    assert [e["step"] for e in evals] == [0, 30, 60]
    assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"] + 0.05
    actor_log = (run.logs_dir / "actor-0.log").read_text()
    assert "synced to version 1 (epoch 1, vllm)" in actor_log
    assert "Traceback" not in actor_log


RETRY_ENV = '''
from async_rl.actor.environments import Turn


class Retry:
    """A wrong answer gets the question again, once; an episode is rewarded 1 when right."""

    def __init__(self, prompt):
        self.prompt, self.turns = prompt, 0

    def step(self, action):
        self.turns += 1
        if action.strip() == self.prompt.answer:
            return Turn(reward=1.0, done=True)
        if self.turns == 2:
            return Turn(reward=0.0, done=True)
        return Turn([{"role": "user", "content": self.prompt.text}])


def make(prompt):
    return Retry(prompt)
'''


def test_a_multi_turn_run_with_vllm_actors(tmp_path) -> None:
    """Episodes on vLLM actors: every turn of the episodes waiting on the policy batched
    into vLLM, the environment's tokens in between, and the run trains on them."""
    (tmp_path / "retry_env.py").write_text(RETRY_ENV)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", "configs/demo.yaml", "actors.engine=vllm",
                           f"env.name={tmp_path / 'retry_env.py'}:make", "env.max_turns=2", "env.max_tokens=16",
                           "train.loss=gspo", "train.correction=geometric_mask",
                           "train.max_steps=30", "eval.every=30", "checkpoint.every=0", f"run_dir={run_dir}"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = RunDir(run_dir)
    steps, evals = run.steps_and_evals()
    assert len(steps) == 30 and max(s["staleness/max"] for s in steps) <= 1
    assert max(s["env/turns_max"] for s in steps) == 2 and all(0 < s["env/multi_turn_frac"] < 1 for s in steps[:5])
    assert all(s["env/policy_token_frac"] < 1 and s["reward/errors"] == 0 for s in steps)
    assert [e["step"] for e in evals] == [0, 30]
    actor_log = (run.logs_dir / "actor-0.log").read_text()
    assert "(epoch 1, vllm)" in actor_log and "Traceback" not in actor_log


def test_a_lora_run_with_vllm_actors_learns(tmp_path) -> None:
    """model.lora on vLLM actors: only the adapters travel (over the plain gloo sync),
    vLLM serves them per request, and the run learns."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", "configs/demo.yaml", "actors.engine=vllm",
                           "model.lora.rank=8", "train.lr=1e-3", "train.max_steps=30", "eval.every=30",
                           "train.correction=sequence_is",
                           "checkpoint.every=0", f"run_dir={run_dir}"], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = RunDir(run_dir)
    steps, evals = run.steps_and_evals()
    full = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(run_dir / "base_model").parameters()) * 4
    assert len(steps) == 30 and all(s["sync/bytes"] < full / 2 for s in steps)
    assert [e["step"] for e in evals] == [0, 30] and evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"] + 0.05
    assert (run_dir / "final" / "adapter_model.safetensors").exists()
    actor_log = (run.logs_dir / "actor-0.log").read_text()
    assert "synced to version 1 (epoch 1, gloo" in actor_log and "Traceback" not in actor_log
