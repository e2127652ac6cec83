"""The episode of a tool the policy calls by writing `OPEN argument CLOSE` in its turn
(the built-in calculator and Python interpreter): a turn with a call is answered by the
tool, as a user turn; a turn without one is the final answer, scored by the task's
reward, and ends the episode. The first complete call of a turn is the one answered.
"""
from __future__ import annotations

from collections.abc import Callable

from async_rl.actor.environments.base import Turn
from async_rl.tasks.base import Prompt


def first_tagged_call(action: str, open_tag: str, close_tag: str) -> str | None:
    """The argument of the turn's first complete `open_tag...close_tag`, found in linear
    time: when the first opening tag has no closing tag after it, no later one has."""
    start = action.find(open_tag)
    if start < 0:
        return None
    end = action.find(close_tag, start + len(open_tag))
    return None if end < 0 else action[start + len(open_tag):end]


class TaggedTool:
    """One episode: answers tool calls with `answer(argument)`; scores the final answer
    with `score(prompt, response, answer)` (the task's reward). Subclasses set the tags
    and `answer`."""

    open_tag: str
    close_tag: str

    def __init__(self, prompt: Prompt, score: Callable[[str, str, str], float]) -> None:
        self.prompt, self.score = prompt, score

    def step(self, action: str) -> Turn:
        argument = first_tagged_call(action, self.open_tag, self.close_tag)
        if argument is None:
            return Turn(reward=self.score(self.prompt.text, action, self.prompt.answer), done=True)
        return Turn([{"role": "user", "content": self.answer(argument)}])

    def answer(self, argument: str) -> str:
        """The tool's reply to one call, as the user turn's text."""
        raise NotImplementedError
