"""The actor's evaluation chunk: its scores come back as one EvalResult, generated with
`eval.threads` intra-op threads, and the actor's own thread count is restored after."""
from __future__ import annotations

import pytest
import torch

from async_rl.actor.engines.torch_engine import TorchEngine
from async_rl.actor.process import evaluate_chunk
from async_rl.actor.rollout.rollout import Rollout
from async_rl.config import build_config
from async_rl.tasks import task_from_config
from async_rl.tasks.base import EVAL_ID_OFFSET
from async_rl.tasks.prompt_format import prompt_format_for
from async_rl.wire import EvalGrant, EvalResult, decode

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("eval_threads", [None, 2])
def test_a_chunk_runs_on_eval_threads_and_restores_the_actors(demo_model, eval_threads):
    cfg = build_config({"model": {"path": str(demo_model)}, "eval": {"threads": eval_threads, "batch_size": 4}})
    task = task_from_config(cfg.task, cfg.seed)
    engine = TorchEngine(str(demo_model))
    seen = []
    generate = engine.generate
    engine.generate = lambda *a, **kw: seen.append(torch.get_num_threads()) or generate(*a, **kw)
    grant = EvalGrant(round=3, version=5, prompt_ids=[EVAL_ID_OFFSET + i for i in range(4)])

    rollout = Rollout.from_config(cfg, engine, prompt_format_for(cfg.model.path, cfg.task), task,
                                  torch.Generator().manual_seed(0))
    result = decode(evaluate_chunk(rollout, grant, actor_id=7, threads=cfg.eval.threads))

    assert seen == [eval_threads or 1] and torch.get_num_threads() == 1
    assert isinstance(result, EvalResult) and (result.round, result.version, result.actor_id) == (3, 5, 7)
    assert list(result.prompt_ids) == list(grant.prompt_ids) and result.rewards.shape == (4, 1)
