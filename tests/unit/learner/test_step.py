"""train_step in a one-process gloo world on a tiny Llama: the diagnostics each algorithm
logs (every key docs/observability.md and docs/algorithms.md name), the histogram weights agree with
is/ess, and the caller's batch is left as it was. Numerical equality with sharded runs is
tests/integration/test_fsdp.py's."""
import collections
import copy
import math

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM
from workers.fsdp_step import synthetic_groups

from async_rl.config import build_config
from async_rl.learner.batching import build_batch
from async_rl.learner.models import Models
from async_rl.learner.step import train_step
from async_rl.models.critic import ValueModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DISTRIBUTION = {f"{prefix}_{stat}" for prefix in ("is/ratio", "is/seq_log_ratio")
                for stat in ("min", "q01", "q50", "q99", "max")}
EVERY_STEP = {"loss/policy", "loss/total", "learner/grad_norm", "learner/skipped_steps", "policy/entropy", "is/ess",
              "is/mismatch_kl", "is/mismatch_k1", "is/clip_frac", "is/clip_frac_low", "is/clip_frac_high",
              "is/dual_clip_frac", "is/masked_frac", "is/masked_seq_frac", "is/truncated_frac", "is/weight_mean",
              "train/zero_adv_group_frac", *DISTRIBUTION}
PPO = {"is/ratio_mean"}
# name: (train section, keys beyond EVERY_STEP)
VARIANTS = {
    "ppo": ({}, PPO),
    "ppo-m2po": ({"correction": "m2po"}, PPO),
    "gspo-geometric-mask": ({"loss": "gspo", "correction": "geometric_mask"}, PPO),
    "cispo-icepop-minibatches": ({"loss": "cispo", "correction": "icepop", "minibatches": 2}, PPO),
    "ppo-kl-loss-entropy-minibatches": ({"minibatches": 2, "entropy_coef": 0.01, "kl": {"coef": 0.1}},
                                        PPO | {"policy/kl_ref", "loss/kl", "loss/entropy"}),
    "opmd-kl-reward": ({"loss": "opmd", "kl": {"coef": 0.1, "mode": "reward"}},
                       {"opmd/residual_mean", "opmd/residual_abs_mean", "opmd/log_ratio_mean", "policy/kl_ref"}),
    "gae": ({"advantage": "gae"}, PPO | {"loss/value", "critic/value_mean", "critic/clip_frac", "critic/grad_norm"}),
}


@pytest.fixture
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_logs_the_algorithms_diagnostics(world, model_dir, variant):
    train, extra = VARIANTS[variant]
    cfg = build_config({"train": {"batch_groups": 4, "group_size": 4, **train},
                        "learner": {"ranks": 1, "micro_batch_size": 4}})
    policy = LlamaForCausalLM.from_pretrained(model_dir)
    models = Models(policy, torch.optim.SGD(policy.parameters(), lr=0.1))
    if cfg.train.kl.coef > 0:
        models.reference = LlamaForCausalLM.from_pretrained(model_dir).requires_grad_(False)
    if cfg.train.advantage.name == "gae":
        models.critic = ValueModel(str(model_dir))
        models.critic_optimizer = torch.optim.SGD(models.critic.parameters(), lr=0.1)
    batch = build_batch(synthetic_groups(4, 4, seed=1), pad_id=0)
    before = copy.deepcopy(batch)
    histograms: dict[str, list[torch.Tensor]] = {}

    stats = train_step(cfg, models, batch, histograms)

    assert stats.keys() == EVERY_STEP | extra
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values()) and stats["learner/skipped_steps"] == 0
    w = torch.cat(histograms["is/weight"])  # raw weights of every response token, float64
    assert w.dtype == torch.float64 and w.numel() == int(batch.loss_mask.sum())
    sequences = torch.cat(histograms["is/seq_log_ratio"])  # one per non-empty response
    assert sequences.numel() == int(batch.loss_mask.any(-1).sum())
    assert stats["is/seq_log_ratio_max"] == pytest.approx(float(sequences.max()), rel=1e-12)
    assert stats["is/ratio_max"] == pytest.approx(float(w.max()), rel=1e-12)
    # float64 sums of the same positive weights in other orders: each within (n - 1)
    # float64 epsilons of the exact sum, the ratio within a few times that.
    ess_rounding = 8 * w.numel() * torch.finfo(torch.float64).eps
    assert stats["is/ess"] == pytest.approx(float(w.sum() ** 2 / (w.numel() * w.square().sum())), rel=ess_rounding)
    assert 0.0 < stats["is/ess"] <= 1.0
    for name in ("rewards", "loss_mask"):  # KL-penalized rewards and filters stay inside the step
        assert torch.equal(getattr(batch, name), getattr(before, name)), name


def test_each_micro_batch_is_laid_out_once_for_all_its_forwards(world, model_dir, monkeypatch):
    """Packed, shared prompts, with a proximal and a reference forward besides the
    policy's: one layout per micro-batch, made once, used by all three forwards."""
    from async_rl.learner import packing

    made, used = [], collections.Counter()
    pack, packed_logits = packing.pack, packing.packed_logits
    monkeypatch.setattr(packing, "pack", lambda *a, **kw: made.append(pack(*a, **kw)) or made[-1])
    monkeypatch.setattr(packing, "packed_logits", lambda model, p: used.update([id(p)]) or packed_logits(model, p))
    cfg = build_config({"train": {"batch_groups": 4, "group_size": 4, "minibatches": 2, "kl": {"coef": 0.1}},
                        "learner": {"ranks": 1, "micro_batch_size": 4, "pack": True, "share_prompt": True}})
    policy = LlamaForCausalLM.from_pretrained(model_dir)
    models = Models(policy, torch.optim.SGD(policy.parameters(), lr=0.1),
                    reference=LlamaForCausalLM.from_pretrained(model_dir).requires_grad_(False))

    stats = train_step(cfg, models, build_batch(synthetic_groups(4, 4, seed=1), pad_id=0))

    assert len(made) == 4  # 4 groups, micro_batch_size = group_size: 4 micro-batches
    assert set(used) == {id(p) for p in made} and list(used.values()) == [3] * 4  # proximal, reference, policy
    assert stats["learner/skipped_steps"] == 0 and math.isfinite(stats["loss/total"])


@pytest.mark.cuda
def test_bf16_fsdp2_step_on_cuda_packed_equals_padded(model_dir):
    """The GPU learner's path: one-rank NCCL world, FSDP2 with bf16 compute, packed shared-
    prompt micro-batches (sdpa with a block mask on the GPU) against padded rows; the
    optimizer sees fp32 master weights and both give the same update up to bf16 rounding."""
    from torch.distributed.device_mesh import init_device_mesh

    from async_rl.learner.sharding import full_parameters, shard_model

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        mesh = init_device_mesh("cuda", (1,))
        batch = build_batch(synthetic_groups(4, 4, seed=1), pad_id=0).to(device)
        init = {n: p.detach().clone() for n, p in LlamaForCausalLM.from_pretrained(model_dir).named_parameters()}
        updates, master = {}, []
        for pack in (False, True):
            cfg = build_config({"train": {"batch_groups": 4, "group_size": 4, "grad_clip": 1e9},
                                "learner": {"ranks": 1, "micro_batch_size": 4, "pack": pack, "precision": "bf16"}})
            policy = shard_model(LlamaForCausalLM.from_pretrained(model_dir).to(device), mesh, precision="bf16")
            models = Models(policy, torch.optim.SGD(policy.parameters(), lr=1.0))
            master.extend(p.dtype for p in policy.parameters())
            stats = train_step(cfg, models, batch)
            assert stats["learner/skipped_steps"] == 0 and math.isfinite(stats["loss/total"])
            updates[pack] = torch.cat([(t.float().cpu() - init[n]).flatten() for n, t in full_parameters(policy)])
        assert set(master) == {torch.float32}
        assert updates[False].norm() > 0
        assert (updates[True] - updates[False]).norm() / updates[False].norm() < 0.1
    finally:
        dist.destroy_process_group()


def _flat_groups_batch(flat: list[int]):
    """4 groups of 4 (random 0/1 rewards); the groups in `flat` all score 1."""
    batch = build_batch(synthetic_groups(4, 4, seed=1), pad_id=0)
    for g in flat:
        batch.rewards[4 * g:4 * g + 4] = 1.0
    return batch


@pytest.mark.parametrize("flat", [[0, 2], [0, 1, 2, 3]])
def test_groups_without_advantage_are_skipped_with_the_same_update(world, model_dir, monkeypatch, flat):
    """learner.skip_zero_advantage leaves out the forward and backward of groups whose
    rewards are all equal (GRPO advantage 0) and gives the same update as training them,
    over two AdamW steps: the same gradients at each step. A step where no group has a
    gradient still trains one (of loss 0): AdamW moves the weights by momentum, and the
    diagnostics describe a real group."""
    from async_rl.learner import packing

    def flat_weights(policy):
        return torch.cat([p.detach().flatten() for p in policy.parameters()])

    grads, forwards = {}, {}
    for skip in (False, True):
        cfg = build_config({"train": {"batch_groups": 4, "group_size": 4},
                            "learner": {"ranks": 1, "micro_batch_size": 4, "skip_zero_advantage": skip}})
        torch.manual_seed(0)
        policy = LlamaForCausalLM.from_pretrained(model_dir)
        models = Models(policy, torch.optim.AdamW(policy.parameters(), lr=1e-2))
        # AdamW scales every update to about lr, so a rounding difference in a tiny gradient
        # could move a weight as far as a large one: the gradients each step sees are compared.
        grads[skip] = seen = []
        step = models.optimizer.step
        monkeypatch.setattr(models.optimizer, "step", lambda *a, seen=seen, step=step, policy=policy, **kw: (
            seen.append(torch.cat([p.grad.flatten() for p in policy.parameters()])), step(*a, **kw))[1])
        train_step(cfg, models, _flat_groups_batch([]))
        calls = []
        packed_logits = packing.packed_logits
        monkeypatch.setattr(packing, "packed_logits",
                            lambda model, p, calls=calls, original=packed_logits: calls.append(1) or original(model, p))
        after_first = flat_weights(policy)
        stats = train_step(cfg, models, _flat_groups_batch(flat))
        monkeypatch.setattr(packing, "packed_logits", packed_logits)
        assert stats["train/zero_adv_group_frac"] == len(flat) / 4 and stats["learner/skipped_steps"] == 0
        assert not torch.equal(flat_weights(policy), after_first)  # with no gradient, by momentum
        forwards[skip] = len(calls)
    assert forwards == {False: 4, True: 4 - len(flat) or 1}  # one micro-batch per group
    assert stats["policy/entropy"] > 0 and stats["is/ess"] > 0
    assert len(grads[True]) == len(grads[False]) == 2
    for got, want in zip(grads[True], grads[False]):
        # The same groups' gradients in the same order, the skipped ones exactly 0: equal
        # but for float32 rounding in kernels that may vary with memory layout.
        bound = 16 * torch.finfo(torch.float32).eps * float(want.abs().max())
        assert float((got - want).abs().max()) <= bound
    if len(flat) == 4:
        assert not grads[True][1].any()


def test_skipping_is_off_where_a_flat_group_still_has_a_gradient(world, model_dir):
    """An entropy bonus reads every token: no group is left out."""
    cfg = build_config({"train": {"batch_groups": 4, "group_size": 4, "entropy_coef": 0.01},
                        "learner": {"ranks": 1, "micro_batch_size": 4}})
    policy = LlamaForCausalLM.from_pretrained(model_dir)
    histograms: dict[str, list[torch.Tensor]] = {}
    batch = _flat_groups_batch([0, 1])
    stats = train_step(cfg, Models(policy, torch.optim.SGD(policy.parameters(), lr=0.1)), batch, histograms)
    assert stats["train/zero_adv_group_frac"] == 0.5
    assert sum(w.numel() for w in histograms["is/weight"]) == int(batch.loss_mask.sum())  # every token was scored
