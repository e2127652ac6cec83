"""One episode as it grows: the policy's turns as sampled, the environment's tokens
between them, and what the learner needs of each token.

Every response is an episode. A single-turn one (no environment) is one policy turn,
scored at its end by the task's reward, also when cut at the length limit; it becomes
a plain response of the sample format (wire.Response): no mask, and no steps unless its
reward scored it step by step (rewards/outcome.py StepRewards). A multi-turn one's
response (everything after the prompt) carries `policy_mask` 1 on the policy's
tokens, whose log-probs and versions are the engine's; 0 on the environment's, with
log-prob 0 and the version of the policy token before them (so they never make the
episode look older than its oldest policy token, which is its version). Each rewarded
turn is a step ending at the last token of the policy turn it rewards.
"""
from __future__ import annotations

import numpy as np

from async_rl.actor.engines.base import Completion
from async_rl.actor.environments.base import Turn
from async_rl.wire import Response


class Episode:
    def __init__(self, prompt_tokens: list[int], max_turns: int, max_tokens: int, environment: bool = True) -> None:
        """`environment`: whether an environment answers its turns (else it is single-turn)."""
        self.prompt_tokens = list(prompt_tokens)
        self.environment = environment
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.mask: list[int] = []
        self.step_ends: list[int] = []
        self.step_rewards: list[float] = []
        self.turns = 0
        self._last_turn_length = 0
        self.reward = 0.0
        self.done = False
        self.truncated = False  # ended by a limit (tokens, turns), not by the environment
        self.failure: str | None = None  # why its user code failed (wire FAILURE_REASONS), if it did
        self.failed_in = ""  # whose code failed: "reward" or "environment"
        self.failure_note = ""  # how it failed, one line
        self.observation_cut = False  # an environment's answer was longer than the budget it could use
        self.components = None  # its reward.components' scores (rewards/components.py), when set

    def prefix(self) -> list[int]:
        """What the policy's next turn is conditioned on."""
        return self.prompt_tokens + self.tokens

    def last_turn(self) -> list[int]:
        """The tokens of the policy's last turn."""
        return self.tokens[len(self.tokens) - self._last_turn_length:]

    def budget(self) -> int:
        """Tokens the episode may still add."""
        return self.max_tokens - len(self.tokens)

    def add_policy_turn(self, completion: Completion) -> None:
        """The policy's turn as sampled. A turn cut before its stop token ends the
        episode (truncated): the environment never sees half a turn."""
        n = len(completion)
        self._last_turn_length = n
        self.tokens += completion.tokens.tolist()
        self.logprobs += completion.logprobs.tolist()
        self.versions += completion.versions.tolist()
        self.mask += [1] * n
        self.turns += 1
        if not completion.finished or n == 0:
            self.done = self.truncated = True
        if not self.environment:  # single-turn: the one turn is the episode
            self.done = True

    def score(self, reward: float, step_ends: list[int] | None = None, step_rewards: list[float] | None = None) -> None:
        """A single-turn episode's reward, given by the task's reward function, and the
        rewards of its steps when the reward gave them (`step_ends`: token offsets in the
        response, in order; steps ending on the same token are one step, their rewards summed)."""
        self.reward = float(reward)
        self.step_ends, self.step_rewards = [], []
        for end, step_reward in zip(step_ends or [], step_rewards or []):
            if self.step_ends and self.step_ends[-1] == end:
                self.step_rewards[-1] += float(step_reward)
            else:
                self.step_ends.append(int(end))
                self.step_rewards.append(float(step_reward))

    def add_environment_turn(self, turn: Turn, tokens: list[int]) -> None:
        """The environment's answer to the last policy turn, and its tokens (`tokens`:
        TurnFormat's; appended only when the episode goes on)."""
        if turn.reward is not None:
            self.step_ends.append(len(self.tokens) - 1)
            self.step_rewards.append(float(turn.reward))
            self.reward += float(turn.reward)
        if turn.done:
            self.done = True
            return
        if self.turns >= self.max_turns or len(tokens) >= self.budget() or self.observation_cut:
            self.done = self.truncated = True
            return
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.versions += [self.versions[-1]] * len(tokens)
        self.mask += [0] * len(tokens)

    def fail(self, reward: float, reason: str, failed_in: str = "environment", note: str = "") -> None:
        """Its environment (or, single-turn, its reward: `failed_in`) failed for `reason`
        (the guard counted it), as `note` says: the episode ends, scored `reward`."""
        self.reward, self.failure, self.failed_in, self.failure_note = reward, reason, failed_in, note
        at_end = self.environment and self.tokens  # a single-turn one's reward is its last token's anyway
        self.step_ends, self.step_rewards = ([len(self.tokens) - 1], [reward]) if at_end else ([], [])
        self.done = True

    def response(self) -> Response:
        tokens = np.asarray(self.tokens, np.int32)
        logprobs, versions = np.asarray(self.logprobs, np.float32), np.asarray(self.versions, np.int32)
        has_steps = bool(self.step_ends)
        return Response(tokens, logprobs, versions,
                        policy_mask=np.asarray(self.mask, np.uint8) if self.environment else None,
                        step_ends=np.asarray(self.step_ends, np.int32) if has_steps else None,
                        step_rewards=np.asarray(self.step_rewards, np.float32) if has_steps else None)
