"""Master weights against their 16-bit copies: the dither that keeps the masters off a
16-bit grid, the dtype the actors hold the weights in, and gathers that always yield the
masters."""
import pytest
import torch

from async_rl.config import build_config
from async_rl.learner.precision import actors_dtype, compute_grid, dither_to_grid, on_grid


def gridded(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Float32 weights of a typical scale that lie exactly on `dtype`'s grid, as a model
    written in that dtype loads."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.05).to(dtype).float()


def spacing(t: torch.Tensor, dtype: torch.dtype, towards: float = float("inf")) -> torch.Tensor:
    """The distance from each value of `t` (on the grid) to the next one of `dtype` towards `towards`."""
    rounded = t.to(dtype)
    return (torch.nextafter(rounded, torch.full_like(rounded, towards)).float() - rounded.float()).abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dither_keeps_the_16bit_copy_and_takes_the_masters_off_the_grid(dtype):
    weights = torch.cat([gridded(100_000, dtype), torch.tensor([0.0, 1.0, -2.0, float("inf")])])
    dithered = dither_to_grid(weights, dtype, torch.Generator().manual_seed(1))
    assert torch.equal(dithered.to(dtype), weights.to(dtype))  # bit for bit what a 16-bit copy holds
    finite = torch.isfinite(weights)
    assert on_grid(dithered[finite], dtype).float().mean() < 0.001
    assert dithered[-1] == float("inf")
    # Spread over the whole interval that rounds to each value: offsets reach beyond a
    # quarter of a spacing on both sides, never half.
    moved = (dithered - weights)[:100_000]
    offset = torch.where(moved > 0, moved / spacing(weights[:100_000], dtype),
                         moved / spacing(weights[:100_000], dtype, float("-inf")))
    assert offset.max() > 0.45 and offset.min() < -0.45 and offset.abs().max() < 0.5


def test_dither_leaves_weights_between_grid_points_alone():
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(10_000, generator=g) * 0.05  # float32 values: almost none on bf16's grid
    off = ~on_grid(weights, torch.bfloat16)
    dithered = dither_to_grid(weights, torch.bfloat16, g)
    assert torch.equal(dithered[off], weights[off])


def test_round_to_nearest_follows_small_updates_only_off_the_grid():
    """The mechanism behind a bf16 policy that does not move: from weights on bf16's grid,
    an update of a fifth of a spacing leaves every bf16 copy where it was; from the
    same weights dithered, a fifth of the copies move by a whole spacing, so that on
    average the copies move by the update (here to within 5%: 200,000 weights)."""
    weights = gridded(200_000, torch.bfloat16)
    update = 0.2 * spacing(weights, torch.bfloat16)
    stuck = (weights + update).to(torch.bfloat16).float() - weights
    assert torch.count_nonzero(stuck) == 0
    dithered = dither_to_grid(weights, torch.bfloat16, torch.Generator().manual_seed(2))
    moved = (dithered + update).to(torch.bfloat16).float() - weights
    assert 0.18 < float((moved != 0).float().mean()) < 0.22
    assert abs(float(moved.sum() / update.sum()) - 1.0) < 0.05


@pytest.mark.parametrize("settings, actors, grid", [
    ({}, torch.float32, None),
    ({"actors": {"engine": {"dtype": "bfloat16"}}}, torch.bfloat16, torch.bfloat16),
    ({"actors": {"engine": {"dtype": "float16"}}}, torch.float16, torch.float16),
    ({"learner": {"precision": "bf16"}}, torch.float32, torch.bfloat16),
    ({"learner": {"precision": "bf16"}, "actors": {"engine": {"dtype": "float16"}}}, torch.float16, torch.bfloat16),
    ({"actors": {"engine": {"name": "vllm", "dtype": "float16"}}}, torch.float16, torch.float16),
])
def test_the_actors_dtype_and_the_grid_the_masters_must_leave(settings, actors, grid):
    cfg = build_config(settings)
    assert actors_dtype(cfg) == actors
    assert compute_grid(cfg) == grid


def test_a_gather_yields_the_master_weights_after_a_forward_without_backward(one_rank_mesh, tiny_llama_dir):
    """One rank, bf16 compute: a forward with no backward (an evaluation) leaves FSDP2's
    bf16 compute copies registered as the parameters; the gather must still give the
    float32 masters (a model written after an evaluation was the bf16 copy)."""
    from transformers import LlamaForCausalLM

    from async_rl.learner.sharding import full_parameters, shard_model

    model = shard_model(LlamaForCausalLM.from_pretrained(tiny_llama_dir), one_rank_mesh, precision="bf16")
    masters = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    gathered = dict(full_parameters(model))
    assert {t.dtype for t in gathered.values()} == {torch.float32}
    assert all(torch.equal(gathered[name], masters[name]) for name in masters)
    assert not all(on_grid(t, torch.bfloat16).all() for t in gathered.values())


def test_from_a_bf16_start_the_16bit_copy_follows_the_updates_only_with_dithered_masters(one_rank_mesh, tmp_path,
                                                                                          tiny_llama_dir):
    """A bf16 learner from a model written in bf16, three AdamW steps at lr 2e-6: every
    weight of magnitude 0.01 or more moves by less than half its bf16 spacing (at least
    3e-5). From masters on the grid no bf16 copy of those weights moves, though the
    masters all did; from dithered masters the copies follow them, a few percent by a
    whole spacing each."""
    from transformers import LlamaForCausalLM
    from workers.fsdp_step import synthetic_groups

    from async_rl.learner.batching import build_batch
    from async_rl.learner.models import build_models
    from async_rl.learner.sharding import full_parameters
    from async_rl.learner.step import train_step

    start = tmp_path / "bf16-start"
    LlamaForCausalLM.from_pretrained(tiny_llama_dir).to(torch.bfloat16).save_pretrained(start)
    begin = {n: p.detach().float() for n, p in LlamaForCausalLM.from_pretrained(start, dtype=torch.float32)
             .named_parameters()}
    large = {n: t.abs() >= 0.01 for n, t in begin.items()}
    moved = {}
    for dither in (False, True):
        cfg = build_config({"model": {"path": str(start)}, "train": {"batch_groups": 4, "group_size": 4, "lr": 2e-6},
                            "learner": {"ranks": 1, "micro_batch_size": 4, "precision": "bf16",
                                        "dither_masters": dither}, "actors": {"engine": {"dtype": "bfloat16"}}})
        models = build_models(cfg, torch.device("cpu"), one_rank_mesh)
        for seed in (1, 2, 3):
            train_step(cfg, models, build_batch(synthetic_groups(4, 4, seed=seed), pad_id=0), {})
        final = dict(full_parameters(models.policy))
        count = sum(int(large[n].sum()) for n in final)
        masters = sum(int(((t - begin[n]).abs() > 0)[large[n]].sum()) for n, t in final.items()) / count
        copies = sum(int((t.to(torch.bfloat16) != begin[n].to(torch.bfloat16))[large[n]].sum())
                     for n, t in final.items()) / count
        moved[dither] = masters, copies
    assert moved[False][0] > 0.5 and moved[True][0] > 0.5  # the masters took the updates either way
    assert moved[False][1] == 0.0
    assert moved[True][1] > 0.02
