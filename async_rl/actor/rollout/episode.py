"""One episode as it grows: the policy's turns as sampled, the environment's tokens
between them, and what the learner needs of each token.

The response of an episode (everything after the prompt) becomes one response of the
sample format (transport.Response): `policy_mask` 1 on the policy's tokens, whose
log-probs and versions are the engine's; 0 on the environment's, with log-prob 0 and
the version of the policy token before them (so they never make the episode look
older than its oldest policy token, which is its version). Each rewarded turn is a
step ending at the last token of the policy turn it rewards.
"""
from __future__ import annotations

import numpy as np

from async_rl.actor.engines import Completion
from async_rl.wire import Response
from async_rl.actor.environments.base import Turn


class Episode:
    def __init__(self, prompt_tokens: list[int], max_turns: int, max_tokens: int) -> None:
        self.prompt_tokens = list(prompt_tokens)
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.mask: list[int] = []
        self.step_ends: list[int] = []
        self.step_rewards: list[float] = []
        self.turns = 0
        self.reward = 0.0
        self.done = False
        self.truncated = False  # ended by a limit (tokens, turns), not by the environment
        self.failure: str | None = None  # why the environment failed (reward_guard.REASONS), if it did

    def prefix(self) -> list[int]:
        """What the policy's next turn is conditioned on."""
        return self.prompt_tokens + self.tokens

    def budget(self) -> int:
        """Tokens the episode may still add."""
        return self.max_tokens - len(self.tokens)

    def add_policy_turn(self, completion: Completion) -> None:
        """The policy's turn as sampled. A turn cut before its stop token ends the
        episode (truncated): the environment never sees half a turn."""
        n = len(completion)
        self.tokens += completion.tokens.tolist()
        self.logprobs += completion.logprobs.tolist()
        self.versions += completion.versions.tolist()
        self.mask += [1] * n
        self.turns += 1
        if not completion.finished or n == 0:
            self.done = self.truncated = True

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
        if self.turns >= self.max_turns or len(tokens) >= self.budget():
            self.done = self.truncated = True
            return
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.versions += [self.versions[-1]] * len(tokens)
        self.mask += [0] * len(tokens)

    def fail(self, reward: float, reason: str) -> None:
        """The environment failed for `reason` (guard.py counted it): the episode ends,
        scored `reward`."""
        self.reward, self.failure = reward, reason
        self.step_ends, self.step_rewards = ([len(self.tokens) - 1], [reward]) if self.tokens else ([], [])
        self.done = True

    def response(self) -> Response:
        has_steps = bool(self.step_ends)
        return Response(np.asarray(self.tokens, np.int32), np.asarray(self.logprobs, np.float32),
                        np.asarray(self.versions, np.int32), policy_mask=np.asarray(self.mask, np.uint8),
                        step_ends=np.asarray(self.step_ends, np.int32) if has_steps else None,
                        step_rewards=np.asarray(self.step_rewards, np.float32) if has_steps else None)
