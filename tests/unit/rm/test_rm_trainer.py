"""rm/trainer.py in a one-process gloo world on a tiny chat Llama under FSDP2: the loss
is Bradley-Terry's (with margin and centering) against hand values, a step's loss and
gradient do not depend on the micro-batch size, a row's score does not depend on its
batch, and the exported model scores, through the reward_model component, what the
trainer scored."""
import json
import math

import pytest
import torch

from async_rl.config import build_config
from async_rl.rewards.reward_model import NORMALIZATION_FILE
from async_rl.rm.pairs import Pair, render
from async_rl.rm.trainer import RMTrainer, pair_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_pair_loss_is_bradley_terry_with_margin_and_centering():
    chosen, rejected, margin = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.5]), torch.tensor([0.0, 0.5])
    # -log sigmoid(1) = 0.313262; -log sigmoid(0 - 0.5 - 0.5) = 1.313262; centering 0.01 * (1, 0.25)
    assert pair_loss(chosen, rejected, margin, 0.0).tolist() == pytest.approx([0.313262, 1.313262], abs=1e-6)
    assert pair_loss(chosen, rejected, margin, 0.01).tolist() == pytest.approx([0.323262, 1.315762], abs=1e-6)


def pairs(n: int, seed: int = 0) -> list[Pair]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(3, 12, (2,), generator=g).tolist()
        chosen, rejected = (torch.randint(3, 200, (k,), generator=g).tolist() for k in lengths)
        out.append(Pair(chosen, rejected, float(torch.rand((), generator=g))))
    return out


def trainer(model_dir, micro: int, **rm) -> RMTrainer:
    cfg = build_config({"model": {"path": str(model_dir)}, "learner": {"ranks": 1, "micro_batch_size": micro},
                        "rm": {"lr": 1e-3, "lr_schedule": "constant", **rm}})
    t = RMTrainer(cfg, torch.device("cpu"))
    t.schedule(total_steps=10)
    return t


def test_a_step_is_the_mean_pair_loss_whatever_the_micro_batches(one_rank_mesh, chat_model):
    batch = pairs(6)
    whole = trainer(chat_model, micro=8, center_coef=0.01)
    with torch.no_grad():
        chosen, rejected = whole.scores([p.chosen for p in batch]), whole.scores([p.rejected for p in batch])
    expected = pair_loss(chosen, rejected, torch.tensor([p.margin for p in batch]), 0.01).mean()
    stats = whole.step(batch)
    assert stats["rm/loss"] == pytest.approx(float(expected), rel=1e-5)
    assert stats["rm/accuracy"] == pytest.approx(float((chosen > rejected).float().mean()))
    assert stats["rm/margin"] == pytest.approx(float((chosen - rejected).mean()), abs=1e-6)
    one_by_one = trainer(chat_model, micro=1, center_coef=0.01).step(batch)
    assert one_by_one["rm/loss"] == pytest.approx(stats["rm/loss"], rel=1e-5)
    assert one_by_one["rm/grad_norm"] == pytest.approx(stats["rm/grad_norm"], rel=1e-4)
    after = whole.evaluate(batch)
    assert after["loss"] < pair_loss(chosen, rejected, torch.tensor([p.margin for p in batch]), 0.0).mean()


def test_a_rows_score_is_its_own_in_any_batch(one_rank_mesh, chat_model):
    t = trainer(chat_model, micro=8)
    rows = [p.chosen for p in pairs(8)]
    with torch.no_grad():
        batched = t.scores(rows)
        alone = torch.cat([t.scores([row]) for row in rows])
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-5)


def test_the_exported_model_scores_through_the_component_what_the_trainer_scored(one_rank_mesh, chat_model,
                                                                                 tmp_path):
    from async_rl.models.loading import load_tokenizer
    from async_rl.rewards.reward_model import RewardModel

    t = trainer(chat_model, micro=4)
    t.step(pairs(4))
    tokenizer = load_tokenizer(str(chat_model))
    questions = [("7+5=", "12"), ("What is 3 times 4?", "It is 12, since 3 * 4 = 12.")]
    with torch.no_grad():
        trained = t.scores([render(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}])
                            for q, a in questions])
    out = tmp_path / "rm"
    t.export(out, tokenizer, {"mean": 0.5, "std": 2.0, "pairs": 4})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert json.loads((out / NORMALIZATION_FILE).read_text())["std"] == 2.0
    prompts, answers = [q for q, _ in questions], [a for _, a in questions]
    scored = RewardModel(out, normalize=False).score_batch(prompts, answers)
    assert scored == pytest.approx(trained.tolist(), abs=1e-5)
    assert not any(math.isnan(s) for s in scored)
    # Served normalized by the written figures, (score - 0.5) / 2, and clipped when asked.
    normalized = RewardModel(out).score_batch(prompts, answers)
    assert normalized == pytest.approx([(s - 0.5) / 2 for s in scored], abs=1e-5)
    clipped = RewardModel(out, clip=1e-3).score_batch(prompts, answers)
    assert clipped == pytest.approx([min(max(s, -1e-3), 1e-3) for s in normalized], abs=1e-9)
