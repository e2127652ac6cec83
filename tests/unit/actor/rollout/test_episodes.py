"""rollout/episodes.py on the real torch engine and a tiny chat model: many episodes in
flight, each turn batched over the episodes ready for it, a slow environment never
holding the engine, and one that hangs failing its episode alone."""
import threading
import time

import pytest
import torch
import transformers

from async_rl.actor.engines.torch_engine import TorchEngine
from async_rl.actor.environments import Turn
from async_rl.actor.guard import Guard
from async_rl.actor.rollout.episodes import Environments, Limits, Sampling, run_episodes
from async_rl.actor.rollout.turns import TurnFormat
from async_rl.tasks.base import Prompt
from async_rl.tasks.prompt_format import PromptFormat

# A gate or a hang waits this long at most: far longer than the timeouts it is to
# outlast, and only spent when something is broken.
WAIT_S = 30.0


class Counting:
    """Answers every turn with its number; done after `turns` turns, rewarding each.
    Prompt "slow" hangs in its first turn until `hang` is set, or, given `gate`, waits
    there until the gate opens and records whether it did."""

    def __init__(self, prompt, turns=2, hang=None, gate=None):
        self.prompt, self.turns, self.hang, self.gate, self.seen = prompt, turns, hang, gate, 0

    def step(self, action):
        self.seen += 1
        if self.prompt.text == "slow" and self.seen == 1:
            if self.gate is not None:
                self.gate["released"].append(self.gate["open"].wait(timeout=WAIT_S))
            elif self.hang is not None:
                self.hang.wait(timeout=WAIT_S)
        done = self.seen == self.turns
        if done and self.gate is not None and self.prompt.text == "fast":
            self.gate["fast_done"].append(True)
            if len(self.gate["fast_done"]) == 2:  # both fast episodes have ended
                self.gate["open"].set()
        return Turn([{"role": "user", "content": f"turn {self.seen}"}], reward=1.0, done=done)


class SpyEngine(TorchEngine):
    def _generate(self, prompts, n, *args):
        self.calls.append((time.monotonic(), len(prompts) * n))  # sequences sampled
        return super()._generate(prompts, n, *args)


@pytest.fixture(scope="module")
def setup(chat_model):
    tok = transformers.AutoTokenizer.from_pretrained(chat_model)
    engine = SpyEngine(str(chat_model), eos_token_id=None)
    pf = PromptFormat(tok)
    return engine, pf, TurnFormat(pf)


def _run(setup, factory, prompts, limits, timeout_s=5.0, fallback=0.0):
    engine, pf, turns = setup
    engine.calls = []
    guard = Guard("test_env", timeout_s=timeout_s, fallback=fallback, kind="environment")
    groups, _ = run_episodes(engine, pf, prompts, 2, limits, Sampling(temperature=1.0),
                             torch.Generator().manual_seed(0), Environments(factory, guard, turns))
    return groups


def test_episodes_take_their_turns_in_one_batch_and_a_turn_cut_at_its_limit_ends_the_episode(setup):
    engine = setup[0]
    saved = engine.eos_token_ids, engine._eos
    engine.eos_token_ids, engine._eos = [], torch.zeros(0, dtype=torch.long)  # no turn ends by itself
    try:
        prompts = [Prompt(id=i, text=f"q{i}", answer="") for i in range(3)]
        groups = _run(setup, lambda p: Counting(p, turns=1), prompts, Limits(3, 64, 4))
    finally:
        engine.eos_token_ids, engine._eos = saved
    assert engine.calls == [(engine.calls[0][0], 6)]  # every episode's turn in one batch, and no other turn
    assert all(ep.done and ep.turns == 1 and ep.truncated and len(ep.tokens) == 4 for g in groups for ep in g)


def test_a_slow_environment_does_not_hold_the_others_and_a_hung_one_fails_alone(setup):
    """Episodes whose turns end by a stop token: the engine's stop ids are the tokens it
    samples here (every token id), so each turn is one token and reaches its environment.
    A hung environment (or factory) fails its episodes at env.timeout_s, the others end whole."""
    engine, pf, turns = setup
    saved = engine.eos_token_ids, engine._eos
    hang_turn, hang_start = threading.Event(), threading.Event()  # set at the end: the hung calls return
    engine.eos_token_ids, engine._eos = list(range(len(pf.tokenizer))), torch.arange(len(pf.tokenizer))
    try:
        prompts = [Prompt(id=0, text="slow", answer=""), Prompt(id=1, text="fast", answer="")]
        # The slow episodes' first answer waits until both fast episodes have ended: the
        # engine must take the fast ones' later turns meanwhile, or the gate never opens.
        gate = {"open": threading.Event(), "released": [], "fast_done": []}
        groups = _run(setup, lambda p: Counting(p, turns=3, gate=gate), prompts, Limits(5, 200, 4),
                      timeout_s=2 * WAIT_S)
        assert gate["released"] == [True, True]
        assert all(ep.done and not ep.truncated and ep.turns == 3 and ep.reward == 3.0 for g in groups for ep in g)
        assert [ep.response().policy_mask.sum() for ep in groups[1]] == [3, 3]

        # The timeout is for the hung calls; the others return at once, even on a slow machine.
        hung = _run(setup, lambda p: Counting(p, turns=3, hang=hang_turn), prompts, Limits(5, 200, 4), timeout_s=1.0,
                    fallback=-1.0)
        assert all(ep.failure == "timeout" and ep.reward == -1.0 and ep.failed_in == "environment"
                   and "timeout of 1s" in ep.failure_note for ep in hung[0])
        assert all(ep.failure is None and ep.reward == 3.0 for ep in hung[1])

        def slow_to_start(p):
            if p.text == "slow":
                hang_start.wait(timeout=WAIT_S)
            return Counting(p, turns=3)

        started = _run(setup, slow_to_start, prompts, Limits(5, 200, 4), timeout_s=1.0, fallback=-1.0)
        assert all(ep.failure == "timeout" and ep.turns == 0 and len(ep.response().tokens) == 0 for ep in started[0])
        assert all(ep.failure is None and ep.reward == 3.0 for ep in started[1])
    finally:
        hang_turn.set()
        hang_start.set()
        engine.eos_token_ids, engine._eos = saved


class Flooding:
    """Answers its first turn with `chars` characters, rewarded 1."""

    def __init__(self, prompt, chars):
        self.chars = chars

    def step(self, action):
        return Turn([{"role": "user", "content": "x" * self.chars}], reward=1.0)


def test_an_answer_longer_than_the_episode_can_take_ends_it_truncated_untokenized_and_is_logged_once(setup, caplog):
    engine, pf, turns = setup
    saved = engine.eos_token_ids, engine._eos
    engine.eos_token_ids, engine._eos = list(range(len(pf.tokenizer))), torch.arange(len(pf.tokenizer))
    tokenized = []

    class Spy(TurnFormat):
        def tokens(self, messages, stop_token):
            tokenized.append(sum(len(m["content"]) for m in messages))
            return super().tokens(messages, stop_token)

    prompts = [Prompt(id=i, text=f"q{i}", answer="") for i in range(2)]
    try:
        with caplog.at_level("WARNING"):
            guard = Guard("flood_env", timeout_s=5.0, kind="environment")
            groups, _ = run_episodes(engine, pf, prompts, 2, Limits(3, 64, 4), Sampling(temperature=1.0),
                                     torch.Generator().manual_seed(0),
                                     Environments(lambda p: Flooding(p, 200_000), guard, Spy(pf)))
            fits, _ = run_episodes(engine, pf, prompts[:1], 1, Limits(2, 64, 4), Sampling(temperature=1.0),
                                   torch.Generator().manual_seed(0),
                                   Environments(lambda p: Flooding(p, 8), guard, Spy(pf)))
    finally:
        engine.eos_token_ids, engine._eos = saved
    episodes = [ep for g in groups for ep in g]
    assert all(ep.observation_cut and ep.done and ep.truncated and ep.turns == 1 and ep.reward == 1.0
               and ep.failure is None for ep in episodes)
    assert tokenized == [8, 8]  # only the short answers were tokenized
    assert not fits[0][0].observation_cut and fits[0][0].turns == 2
    lines = [r.getMessage() for r in caplog.records if "flood_env" in r.getMessage()]
    assert len(lines) == 1 and "ends truncated" in lines[0], lines
