"""The generation-engine interface shared by every engine (torch, vLLM, ...).

An actor owns one engine. The engine turns prompt token ids into sampled responses
and records, per response token, the two things the learner needs to correct for
staleness: the log-probability under the distribution the token was actually drawn
from, and the policy version of the weights that drew it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Completion:
    """One sampled response to one prompt."""

    tokens: torch.Tensor  # int64 [L] response token ids (includes the EOS token if one was sampled)
    logprobs: torch.Tensor  # float32 [L] log-prob of each token under the processed sampling distribution
    versions: torch.Tensor  # int32 [L] policy version that produced each token
    finished: bool  # True if EOS was produced, False if cut by max_new_tokens

    def __len__(self) -> int:
        return int(self.tokens.numel())


class GenerationEngine(ABC):
    """What the actor needs from an engine.

    `version` is the policy version of the weights currently loaded; weight sync
    writes new values into `parameters_for_sync()` in place and then calls
    `set_version`. An engine implements `_generate`; `generate` refuses bad arguments
    the same way for every engine first.

    `step_hook`, when set, is called between two decoding steps of `_generate` (never
    before the first token): sync.in_flight sets it, and the actor loads new weights
    there and bumps `version`; None keeps the loop free of any hub traffic.
    """

    version: int
    eos_token_ids: list[int]  # the stop ids: a response that samples one ends there, finished
    step_hook: Callable[[], None] | None = None

    def _between_steps(self) -> None:
        """Safe point between decoding steps, where in-flight weight updates land.

        Nothing of the model is in use here, so the hook may overwrite its weights.
        Unfinished responses then continue on the new weights with the KV cache as it
        is, like PipelineRL: the keys/values of earlier tokens stay those the old
        weights computed (recomputing them would cost a prefill per update). The
        log-probs recorded from then on are still those of the distribution actually
        sampled from (new weights over that cache), which is what the learner's
        importance ratios need, and each token records the version that sampled it.
        An exception from the hook aborts the whole generate call.
        """
        if self.step_hook is not None:
            self.step_hook()

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> list[list[Completion]]:
        """Sample `n` responses per prompt; result[i][j] is the j-th sample for prompt i."""
        if not prompts:
            return []
        if n < 1 or max_new_tokens < 1:
            raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got {n=}, {max_new_tokens=}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: there is no token to condition on")
        if not greedy and not (temperature > 0.0 and 0.0 < top_p <= 1.0):
            raise ValueError(f"need temperature > 0 and 0 < top_p <= 1, got {temperature=}, {top_p=}")
        return self._generate(prompts, n, max_new_tokens, temperature, top_p, greedy, generator)

    @abstractmethod
    def _generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float,
                  greedy: bool, generator: torch.Generator | None) -> list[list[Completion]]:
        """`generate` on arguments already checked (at least one prompt)."""

    @abstractmethod
    def parameters_for_sync(self) -> list[tuple[str, torch.Tensor]]:
        """The model's named parameters (tied weights once), in a deterministic order."""

    @abstractmethod
    def set_version(self, version: int) -> None:
        """Record that the loaded weights are now policy version `version`."""
