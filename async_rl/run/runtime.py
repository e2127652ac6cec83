"""Glue from a Config to concrete components, shared by the learner and the actors."""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

from async_rl.config import Config
from async_rl.run.directory import STATUS_FILE


def quiet_libraries() -> None:
    """Per-load progress bars from transformers would drown the run's own progress bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def preload_model_libraries() -> None:
    """Import transformers' model and tokenizer machinery now, seconds of imports that
    loading a model would otherwise do: an actor started alongside its learner does it
    while the learner starts up, not after joining."""
    import importlib

    for module in ("modeling_utils", "models.auto.modeling_auto", "models.auto.tokenization_auto"):
        importlib.import_module(f"transformers.{module}")


def resolve_device(name: str) -> torch.device:
    """model.device as a torch device; a GPU always with its index (this process's current
    device: a learner rank sets its own first), since per-thread calls such as
    `torch.cuda.set_device` refuse a bare "cuda"."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("model.device=cuda but no CUDA device is visible")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def sync_backend(device: torch.device) -> str:
    """torch.distributed backend for tensors on this device: NCCL on GPU, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def make_task_from_config(cfg: Config):
    from async_rl.tasks import WithReward, load_reward_fn, make_task

    t = cfg.task
    if t.name == "jsonl":
        return make_task("jsonl", seed=cfg.seed, path=t.train_path, eval_path=t.eval_path, reward=t.reward)
    if t.name == "reasoning_gym":
        return make_task("reasoning_gym", seed=cfg.seed, dataset=t.dataset, options=t.dataset_options,
                         eval_size=t.eval_size, system_prompt=t.system_prompt)
    options = {"digits": t.digits} if t.name == "arithmetic" else {}
    task = make_task(t.name, seed=cfg.seed, eval_size=t.eval_size, **options)
    return WithReward(task, load_reward_fn(t.reward)) if t.reward else task


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def make_prompt_format(cfg: Config, tokenizer=None):
    """How this run turns prompts into tokens (prompting.py); loads its own tokenizer
    unless given one (a fast tokenizer must not be shared between threads)."""
    from async_rl.tasks.prompt_format import PromptFormat

    return PromptFormat(tokenizer if tokenizer is not None else load_tokenizer(cfg.model.path),
                        cfg.task.chat_template, cfg.task.system_prompt)


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def exit_now(code: int) -> None:
    """Flush everything, then end the process without running C++ static destructors.

    With torch 2.13 CPU, a process that held gloo process groups intermittently
    aborts during interpreter teardown ("terminate called without an active
    exception"), after all its work is done, turning a clean run into exit status -6.
    Every file this project writes is closed before this point, so skipping the
    teardown loses nothing.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


EXIT_CONFIG = 2  # a config error found only once running (e.g. every prompt over the limit)
EXIT_NONFINITE = 3  # `async-rl train` status after repeated non-finite steps
EXIT_REWARD_ERRORS = 4  # ... after a step with too many samples scored reward.fallback
EXIT_STALLED = 5  # no experience for learner.timeout_s (every actor gone)
# Set by `async-rl train` for the learner world: it holds the run directory's lock and
# prints a failure's one console line itself.
LAUNCHER_ENV = "ASYNC_RL_LAUNCHER"


def write_status(run_dir: Path, exit_code: int, reason: str) -> None:
    """How the learner ended, for the launcher (RunDir.status reads it): {"exit_code": int,
    "reason": str}."""
    tmp = run_dir / (STATUS_FILE + ".tmp")
    tmp.write_text(json.dumps({"exit_code": exit_code, "reason": reason}))
    os.replace(tmp, run_dir / STATUS_FILE)


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process below it (Linux /proc), parents before children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the command may contain ")"
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop(0))
        todo.extend(children.get(tree[-1], []))
    return tree


def die_with_parent(sig: int = 9) -> None:
    """Ask the kernel to send `sig` (default SIGKILL) to this process when its parent
    dies (Linux prctl PR_SET_PDEATHSIG; a no-op elsewhere). Safe in a Popen preexec_fn:
    the setting survives exec. A parent already gone before the call is caught by
    comparing with the parent pid the caller expects."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(1, sig, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def child_of(parent_pid: int):
    """A Popen preexec_fn: the child dies with `parent_pid` (SIGKILL: nothing of a run
    may go on unsupervised), and exits at once if that parent is already gone."""
    def setup() -> None:
        die_with_parent()
        if os.getppid() != parent_pid:
            os._exit(1)
    return setup
