"""environments/skyrl.py on the real skyrl-gym package: its environments answer as they
do in SkyRL (observations, turn rewards, done), env.options reach their env_config,
close() is called, and what the adapter cannot carry fails one episode, counted."""
import time

import pytest
import torch
import transformers

skyrl_gym = pytest.importorskip("skyrl_gym")

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402
from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv  # noqa: E402

from async_rl.actor.engines.torch_engine import TorchEngine  # noqa: E402
from async_rl.actor.environments import Turn  # noqa: E402
from async_rl.actor.environments.registry import environment_factory  # noqa: E402
from async_rl.actor.guard import Guard  # noqa: E402
from async_rl.actor.rollout.episodes import Environments, Limits, Sampling, run_episodes  # noqa: E402
from async_rl.actor.rollout.turns import TurnFormat  # noqa: E402
from async_rl.tasks.base import Prompt  # noqa: E402
from async_rl.tasks.prompt_format import PromptFormat  # noqa: E402

PROMPT = Prompt(id=0, text="Ann has 3 pens and buys 4 more. How many pens?", answer="7")
CLOSED = []


class Echo(BaseTextEnv):
    """Reads env_config.reply; rewards 0.5 a turn; records close()."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.reply, self.max_turns = env_config.reply, extras["max_turns"]

    def step(self, action):
        self.turns += 1
        done = self.turns >= self.max_turns
        return BaseTextEnvStepOutput(observations=[] if done else [{"role": "user", "content": self.reply}],
                                     reward=0.5, done=done, metadata={})

    def close(self):
        CLOSED.append(self.turns)


class Rewriter(Echo):
    def init(self, prompt):
        return [{"role": "system", "content": "You are a tool user."}] + prompt, {}


skyrl_gym.register(id="async_rl_test_echo", entry_point=Echo)
skyrl_gym.register(id="async_rl_test_rewriter", entry_point=Rewriter)


def test_gsm8k_multi_turn_answers_as_in_skyrl():
    env = environment_factory("skyrl_gym/gsm8k_multi_turn", None, {}, max_turns=3)(PROMPT)
    theirs = GSM8kMultiTurnEnv(extras={"reward_spec": {"ground_truth": "7"}, "extra_info": {}, "max_turns": 3})
    for action in ("It is 6. #### 6", "Let me see", "#### 7"):
        turn, expected = env.step(action), theirs.step(action)
        assert turn == Turn(expected["observations"], expected["reward"], expected["done"])
    assert turn.done and turn.reward == 1.0


def test_options_reach_env_config_and_max_turns_the_extras():
    env = environment_factory("skyrl_gym/async_rl_test_echo", None, {"reply": "again"}, max_turns=2)(PROMPT)
    assert env.step("a") == Turn([{"role": "user", "content": "again"}], 0.5, False)
    assert env.step("b") == Turn([], 0.5, True)


def test_unknown_environments_are_one_line():
    with pytest.raises(ValueError, match=r"skyrl-gym has no environment 'nope' \(it has .*gsm8k") as err:
        environment_factory("skyrl_gym/nope", None)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def engine_and_format(chat_model):
    pf = PromptFormat(transformers.AutoTokenizer.from_pretrained(chat_model))
    engine = TorchEngine(str(chat_model), eos_token_id=None)
    # Every token stops a turn: each turn is one token and reaches the environment.
    engine.eos_token_ids, engine._eos = list(range(len(pf.tokenizer))), torch.arange(len(pf.tokenizer))
    return engine, pf, TurnFormat(pf)


def _episodes(engine_and_format, name, options):
    engine, pf, turns = engine_and_format
    guard = Guard(name, timeout_s=10.0, fallback=-1.0, kind="environment")
    environments = Environments(environment_factory(name, None, options, max_turns=3), guard, turns)
    limits = Limits(max_turns=3, max_tokens=60, turn_tokens=4)
    groups, _ = run_episodes(engine, pf, [PROMPT], 2, limits, Sampling(temperature=1.0),
                             torch.Generator().manual_seed(0), environments)
    return groups[0]


def test_episodes_run_to_the_environments_end_and_close_it(engine_and_format):
    CLOSED.clear()
    episodes = _episodes(engine_and_format, "skyrl_gym/async_rl_test_echo", {"reply": "again"})
    for ep in episodes:
        assert ep.failure is None and ep.turns == 3 and ep.reward == pytest.approx(1.5)
        assert ep.step_rewards == [0.5] * 3 and 0 in ep.mask  # the replies are the environment's tokens
    deadline = time.monotonic() + 30  # close() runs in a thread of its own
    while len(CLOSED) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert CLOSED == [3, 3]


def test_an_init_that_rewrites_the_prompt_fails_its_episodes(engine_and_format):
    episodes = _episodes(engine_and_format, "skyrl_gym/async_rl_test_rewriter", {"reply": "x"})
    assert [(ep.failure, ep.reward, ep.turns) for ep in episodes] == [("raised", -1.0, 0)] * 2


def test_an_environment_that_needs_a_field_of_its_row_gets_it_from_the_prompt():
    """skyrl-gym's `aime` asserts on a `reward_model` extra, which SkyRL's datasets carry
    as a column: a dataset task's other columns reach it as they are."""
    make = environment_factory("skyrl_gym/aime", {}, max_turns=1)
    with pytest.raises(AssertionError, match="reward_model field is required"):
        make(PROMPT)
    row = Prompt(id=0, text=PROMPT.text, answer="7",
                 fields={"reward_model": {"method": "rule", "ground_truth": "7"}, "data_source": "aime"})
    assert make(row).step("Answer: 7").reward == 1.0  # aime's format; a miss scores -1
    assert make(row).step("Answer: 8").reward == -1.0
