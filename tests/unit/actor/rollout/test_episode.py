"""rollout/episode.py: a two-turn episode sampled by the real torch engine on a tiny chat
model, with an environment's answer between the turns, becomes one sample whose policy
tokens the learner scores exactly as the engine sampled them, and whose environment
tokens are context only."""
import numpy as np
import pytest
import torch
import transformers

from async_rl.actor.engines import Completion
from async_rl.actor.engines.torch_engine import TorchEngine
from async_rl.actor.environments import Turn
from async_rl.actor.rollout.episode import Episode
from async_rl.actor.rollout.turns import TurnFormat
from async_rl.learner.batching import build_batch
from async_rl.learner.step import forward_logp
from async_rl.tasks.base import Prompt
from async_rl.tasks.prompt_format import PromptFormat
from async_rl.wire import ExperienceGroup, decode, encode


def _completion(tokens, finished=True, version=0) -> Completion:
    n = len(tokens)
    return Completion(torch.tensor(tokens), torch.full((n,), -0.5), torch.full((n,), version, dtype=torch.int32),
                      finished)


def test_turns_rewards_and_limits():
    ep = Episode([1, 2], max_turns=3, max_tokens=20)
    ep.add_policy_turn(_completion([5, 6], version=3))
    ep.add_environment_turn(Turn([{"role": "user", "content": "x"}], reward=0.5), tokens=[90, 91, 92])
    ep.add_policy_turn(_completion([7], version=4))
    ep.add_environment_turn(Turn(reward=1.0, done=True), tokens=[99])
    assert ep.done and not ep.truncated and ep.reward == 1.5
    r = ep.response()
    assert r.tokens.tolist() == [5, 6, 90, 91, 92, 7] and r.policy_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert r.versions.tolist() == [3, 3, 3, 3, 3, 4] and r.logprobs.tolist()[2:5] == [0, 0, 0]
    assert r.step_ends.tolist() == [1, 5] and r.step_rewards.tolist() == [0.5, 1.0]
    assert ep.prefix() == [1, 2, 5, 6, 90, 91, 92, 7]


@pytest.mark.parametrize("limit", ["cut_turn", "turns", "tokens"])
def test_an_episode_ended_by_a_limit_is_truncated(limit):
    ep = Episode([1], max_turns=1 if limit == "turns" else 5, max_tokens=4 if limit == "tokens" else 50)
    ep.add_policy_turn(_completion([5, 6], finished=limit != "cut_turn"))
    if not ep.done:
        ep.add_environment_turn(Turn([{"role": "user", "content": "x"}]), tokens=[90, 91])
    assert ep.done and ep.truncated and ep.response().tokens.tolist() == [5, 6]


def test_a_failed_environment_ends_the_episode_with_the_fallback_as_its_one_step():
    ep = Episode([1], max_turns=5, max_tokens=50)
    ep.add_policy_turn(_completion([5, 6]))
    ep.add_environment_turn(Turn([{"role": "user", "content": "x"}], reward=1.0), tokens=[90])
    ep.add_policy_turn(_completion([7]))
    ep.fail(-1.0, "raised")
    r = ep.response()
    assert ep.done and ep.reward == -1.0 and ep.failure == "raised"
    assert r.step_ends.tolist() == [3] and r.step_rewards.tolist() == [-1.0]


def test_the_learner_scores_the_policys_tokens_as_the_engine_sampled_them(chat_model):
    tok = transformers.AutoTokenizer.from_pretrained(chat_model)
    # Both in float64, where the engine's cached forwards and the learner's differ by ~1e-16
    # (in float32, by what the CPU's kernels make of their different shapes).
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float64).eval()
    engine = TorchEngine(str(chat_model), eos_token_id=None, dtype=torch.float64)
    pf = PromptFormat(tok)
    turns = TurnFormat(pf)
    gen = torch.Generator().manual_seed(0)
    ep = Episode(pf.encode(Prompt(id=0, text="What is 7 + 5?", answer="12")), max_turns=2, max_tokens=64)
    for turn in range(2):
        [[c]] = engine.generate([ep.prefix()], n=1, max_new_tokens=5, temperature=1.0, generator=gen)
        # The tiny random model never samples its stop token: close the turn as if it had.
        ep.add_policy_turn(Completion(c.tokens, c.logprobs, c.versions, finished=True))
        observation = [{"role": "user", "content": f"The tool says {turn}."}]
        ep.add_environment_turn(Turn(observation, reward=float(turn), done=turn == 1), turns.tokens(observation, None))
    response = ep.response()
    group = decode(encode(ExperienceGroup.from_responses(
        [response], actor_id=0, group=0, prompt_id=0, version=0, prompt_tokens=np.asarray(ep.prompt_tokens, np.int32),
        rewards=np.array([ep.reward], np.float32), truncated=np.zeros(1, np.uint8), gen_seconds=0.0)))
    batch = build_batch([group], pad_id=tok.pad_token_id)
    with torch.no_grad():
        logp, _ = forward_logp(model, batch, temperature=1.0)
        scale = float(model(input_ids=batch.tokens, attention_mask=batch.attention).logits.abs().max())
    scored = batch.loss_mask[0].bool()
    assert int(scored.sum()) == 10 and len(response.tokens) > 10  # 2 turns of 5, and the environment's between
    # The engine takes the softmax of float32 logits (in any dtype) and records float32
    # log-probs, and transformers' RMSNorm computes in float32: a few float32 epsilons of
    # the logits' scale.
    sampled = torch.from_numpy(response.logprobs[response.policy_mask == 1]).double()
    assert float((logp[0][scored] - sampled).abs().max()) <= 16 * torch.finfo(torch.float32).eps * scale
    assert (batch.logp_behav[0][~scored] == 0).all()
