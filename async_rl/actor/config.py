"""The actors' sections: how many, which engine, how they sample, and where and how
user reward code runs."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from async_rl.config.section import Section, choice


class TorchEngineConfig(Section):
    name: Literal["torch"] = "torch"
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights and compute of the torch engine (16-bit ones: weights also travel in it).")
    attention: Literal["sdpa", "eager"] | None = Field(None, description="The engine's attention kernel (null = the model's default); in bfloat16 on a CPU `eager` is faster for short rows.")
    compile: bool = Field(False, description="torch.compile each transformer block (prefill and decode, dynamic shapes); off by default: docs/performance.md has where it wins.")


class VLLMEngineConfig(Section):
    name: Literal["vllm"] = "vllm"
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("float32", description="vLLM's compute dtype (16-bit ones also carry the weights); `auto` = the model's.")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + response vLLM accepts (null = the model's positions).")
    kv_cache_gb: float = Field(1.0, gt=0.0, description="CPU: KV-cache memory per actor, in GiB.")
    gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0, description="GPU: the share of its memory vLLM may take.")
    enforce_eager: bool = Field(True, description="Run the model eagerly; false lets vLLM compile it (slower start, faster decoding).")


EngineConfig = choice(TorchEngineConfig, VLLMEngineConfig, default=TorchEngineConfig)


class ActorsConfig(Section):
    count: int = Field(1, ge=1, le=256, description="Actor processes `async-rl train` starts.")
    engine: EngineConfig = Field(default_factory=TorchEngineConfig, description="Generation engine: `torch` (any model, any device) or `vllm`.")
    groups_per_request: int = Field(8, ge=1, description="Prompt groups an actor asks for, and generates as one batch.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature (recorded log-probs are tempered too).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(8, ge=1, description="Response length limit; a response cut there is flagged truncated.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (the model's EOS ids always stop a response).")
    threads: int = Field(1, ge=1, description="torch intra-op threads per actor (CPU).")
    heartbeat_s: float = Field(1.0, gt=0.0, description="Seconds between an actor's heartbeats.")
    heartbeat_timeout_s: float = Field(30.0, gt=0.0, description="An actor silent this long is declared dead.")
    max_restarts: int = Field(3, ge=0, description="Restarts of a local actor that exits unexpectedly (0 = never).")
    connect_timeout_s: float = Field(60.0, gt=0.0, description="How long an actor retries a hub that does not answer.")


class JudgeConfig(Section):
    url: str | None = Field(None, description="An OpenAI-compatible server (its base, e.g. http://127.0.0.1:8000/v1, or its /chat/completions); null = the component's `model`, a causal LM run in the reward's workers.")
    served_model: str = Field("judge", description="The `model` name sent to the server.")
    template: str = Field("Question: {prompt}\nReference answer: {answer}\nResponse: {response}\nIs the response correct? Answer yes or no.", description="What the judge is asked: {prompt}, {response} and {answer} filled in.")
    parser: Literal["verdict", "score"] = Field("verdict", description="`verdict`: the reply's first word yes/no (correct/incorrect, true/false) as 1/0; `score`: its first number. Anything else is unscorable.")
    max_tokens: int = Field(16, ge=1, le=4096, description="The judge's reply length limit.")
    retries: int = Field(3, ge=0, le=10, description="Further attempts after a connection error or an HTTP 5xx/429 (never after a timeout), within reward.timeout_s.")
    api_key_env: str | None = Field(None, description="The environment variable holding the server's API key (sent as a bearer token), if it needs one.")


class RewardComponentConfig(Section):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="The component's name in metrics (reward/<name>/mean, ...).")
    reward: str = Field(description="`task` (the task's own reward), `reward_model` or `prm` (a learned one at `model`), `judge` (an LLM judge), a built-in, `module:function` or `file.py:function`.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Its weight in the sample's reward; 0 = scored and logged, not trained on.")
    model: str | None = Field(None, description="With reward: reward_model or prm, an HF sequence-classification model directory with one output; with judge, a causal LM directory.")
    normalize: bool = Field(True, description="With reward: reward_model or prm, scores as (score - mean) / std by the model's reward_normalization.json (written by `async-rl rm`), when it has one.")
    clip: float | None = Field(None, gt=0.0, description="With reward: reward_model or prm, the (normalized) score clamped to +-clip (null = not clamped).")
    separator: str = Field("\n\n", min_length=1, description="With reward: prm, what ends each step of a response.")
    aggregate: Literal["steps", "min", "last", "mean"] = Field("steps", description="With reward: prm, the sample's reward: `steps`, each step's score a step reward (train.advantage.name=grpo_process) summing to it; or their min, last or mean.")
    judge: JudgeConfig | None = Field(None, description="With reward: judge, the judge (its server, or `model`), its question and how its reply is read.")
    scope: Literal["sample", "group"] = Field("sample", description="`group`: f(prompt, responses, answer, ...) scores a prompt's whole group at once (pairwise, listwise judges), one score per response.")
    placement: Literal["inline", "server"] = Field("inline", description="With reward: reward_model, prm or a judge's `model`: `inline`, a copy per reward worker; `server`, one copy in the reward server (`reward_server`), batched across actors.")

    @model_validator(mode="after")
    def _model_for_a_reward_model(self) -> RewardComponentConfig:
        if self.reward == "judge":
            if ((self.judge or JudgeConfig()).url is None) == (self.model is None):
                raise ValueError(f"reward.components: a judge is a server (judge.url) or a causal LM (model), one of "
                                 f"them (component {self.name!r})")
        elif (self.reward in ("reward_model", "prm")) != (self.model is not None):
            raise ValueError("reward.components: `model` is for, and needed by, `reward: reward_model`, `prm` or "
                             f"`judge` (component {self.name!r})")
        if self.judge is not None and self.reward != "judge":
            raise ValueError(f"reward.components: `judge` is for `reward: judge` (component {self.name!r})")
        if self.placement == "server" and (self.model is None or self.reward not in ("reward_model", "prm", "judge")):
            raise ValueError(f"reward.components: placement: server is for a reward_model, prm or judge `model` "
                             f"(component {self.name!r})")
        if self.scope == "group" and self.reward in ("task", "reward_model", "prm", "judge"):
            raise ValueError(f"reward.components: scope: group is for a function of a group's responses, "
                             f"not {self.reward!r} (component {self.name!r})")
        return self


class RewardConfig(Section):
    executor: Literal["process", "thread"] = Field("process", description="Where the task's reward runs: `process`, workers killed at a call's deadline; `thread`, in the actor (no start-up; a call past its deadline may keep a core busy).")
    workers: int = Field(2, ge=1, le=256, description="Reward worker processes per actor (reward.executor=process).")
    in_flight: int = Field(2, ge=0, le=64, description="Grants whose samples may wait for their rewards while the actor generates more (scored in a thread of their own); 0 scores each grant before the next.")
    timeout_s: float = Field(10.0, gt=0.0, description="A reward call running longer is stopped and fails as `timeout`.")
    on_failure: Literal["exclude", "fallback"] = Field("exclude", description="A sample whose reward or environment failed: `exclude` leaves it out of its group and the loss (a group left with < 2 is dropped); `fallback` trains on reward.fallback.")
    fallback: float = Field(0.0, allow_inf_nan=False, description="The reward a failed call scores: in evaluations, and in training with reward.on_failure=fallback.")
    components: list[RewardComponentConfig] = Field(default_factory=list, max_length=16, description="Reward sources summed with weights (each timed and logged on its own); empty = the task's reward alone.")
    max_error_frac: float = Field(0.5, ge=0.0, le=1.0, description="A step with a larger share of failed reward or environment calls stops the run (exit 4).")

    @model_validator(mode="after")
    def _components_named_once(self) -> RewardConfig:
        names = [c.name for c in self.components]
        if len(set(names)) < len(names):
            raise ValueError(f"reward.components: names must differ, got {names}")
        if self.components and all(c.weight == 0.0 for c in self.components):
            raise ValueError("reward.components: at least one component needs a weight other than 0")
        return self
