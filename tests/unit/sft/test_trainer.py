"""The supervised step in a one-process gloo world on a tiny chat Llama under FSDP2: its
loss is the mean negative log-likelihood of the batch's assistant tokens, computed by
hand here, and neither it nor the gradient depends on the micro-batch size; the split
cuts, drops and holds out as documented."""
import math

import pytest
import torch

from async_rl.config import build_config
from async_rl.sft.conversations import Demonstration
from async_rl.sft.trainer import SFTTrainer, split_demonstrations

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def demos(n: int, seed: int = 0) -> list[Demonstration]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (1,), generator=g))
        prompt = int(torch.randint(1, length - 1, (1,), generator=g))
        ids = torch.randint(3, 200, (length,), generator=g).tolist()
        out.append(Demonstration(ids, [False] * prompt + [True] * (length - prompt)))
    return out


def trainer(model_dir, micro: int) -> SFTTrainer:
    cfg = build_config({"model": {"path": str(model_dir)}, "learner": {"ranks": 1, "micro_batch_size": micro},
                        "sft": {"lr": 1e-3, "lr_schedule": "constant"}})
    t = SFTTrainer(cfg, torch.device("cpu"), pad_id=2)
    t.schedule(total_steps=10)
    return t


def hand_loss(model_dir, batch) -> float:
    """Mean over the batch's trained tokens of -log p(token | the tokens before it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).requires_grad_(False)
    nll, count = 0.0, 0
    for d in batch:
        logp = torch.log_softmax(model(input_ids=torch.tensor([d.ids])).logits[0, :-1], -1)
        for pos in range(1, len(d.ids)):
            if d.trained[pos]:
                nll -= float(logp[pos - 1, d.ids[pos]])
                count += 1
    return nll / count


def test_the_loss_is_the_mean_nll_of_the_assistant_tokens_whatever_the_micro_batches(one_rank_mesh, chat_model):
    batch = demos(6)
    whole = trainer(chat_model, micro=8).step(batch)
    expected = hand_loss(chat_model, batch)
    # float32 forward against a float64 reference: a few float32 roundings of a loss ~5.
    assert whole["sft/loss"] == pytest.approx(expected, rel=1e-5)
    assert whole["sft/tokens"] == sum(sum(d.trained[1:]) for d in batch)
    one_by_one = trainer(chat_model, micro=1).step(batch)
    assert one_by_one["sft/loss"] == pytest.approx(whole["sft/loss"], rel=1e-5)
    assert one_by_one["sft/grad_norm"] == pytest.approx(whole["sft/grad_norm"], rel=1e-4)


def test_steps_lower_the_loss(one_rank_mesh, chat_model):
    t, batch = trainer(chat_model, micro=8), demos(8, seed=1)
    losses = [t.step(batch)["sft/loss"] for _ in range(10)]
    assert losses[-1] < losses[0] - 0.5, losses
    assert t.held_out_loss(batch) < losses[0]


def test_the_split_cuts_drops_and_holds_out(chat_model):
    ds = demos(20) + [Demonstration([5] * 30, [False] * 20 + [True] * 10)]  # its trained part is past the cut
    split = split_demonstrations(ds, max_tokens=12, eval_fraction=0.1, seed=0)
    assert split.cut == 1 and len(split.held_out) == math.ceil(0.1 * 20) and len(split.train) == 18
    assert all(len(d.ids) <= 12 for d in split.train + split.held_out)
    again = split_demonstrations(ds, max_tokens=12, eval_fraction=0.1, seed=0)
    assert [d.ids for d in again.held_out] == [d.ids for d in split.held_out]
    assert split_demonstrations(ds[:1], 12, 0.5, 0).held_out == []  # one conversation: all of it trains
    with pytest.raises(ValueError, match="sft.max_tokens=4"):
        split_demonstrations(ds[-1:], max_tokens=4, eval_fraction=0.0, seed=0)
