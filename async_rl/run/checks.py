"""What `async-rl train` checks before it starts anything, so that a bad engine, task,
reward or environment is one line (ConfigError, exit 2) instead of a traceback in every
spawned process: each is built as the processes will build it and tried on a sample."""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from async_rl.config import Config, ConfigError
from async_rl.device import resolve_device
from async_rl.models.loading import load_tokenizer
from async_rl.rewards.outcome import Failed, as_outcome
from async_rl.tasks import task_from_config
from async_rl.tasks.prompt_format import prompt_format_for

log = logging.getLogger("async_rl.launch")


def check_engine(cfg: Config, model: bool = False) -> None:
    """vLLM actors: vLLM importable here, as each actor will import it, and (`model`) a
    model and settings it can run; in one line (exit 2) before anything starts, instead
    of in every actor. Nothing to check for the torch engine."""
    if cfg.actors.engine.name != "vllm":
        return
    from async_rl.weight_transfer.vllm.api import VLLMUnavailable, require_vllm

    try:
        require_vllm()
    except VLLMUnavailable as err:
        raise ConfigError(str(err)) from None  # it names actors.engine
    if model:
        from transformers import AutoConfig

        from async_rl.actor.engines.vllm_engine import VLLMConfigError, check_model

        try:
            check_model(AutoConfig.from_pretrained(cfg.model.path), resolve_device(cfg.model.device),
                        cfg.actors.engine.max_model_len)
        except VLLMConfigError as err:
            raise ConfigError(str(err)) from None


def check_lora(cfg: Config) -> None:
    """model.lora: peft importable and every target module a linear layer of the model."""
    if not cfg.model.lora.rank:
        return
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("model.lora.rank: LoRA needs the peft package: pip install 'async-rl[lora]'")
    from async_rl.lora.adapters import check_targets

    problem = check_targets(cfg.model.path, cfg.model.lora.target_modules)
    if problem:
        raise ConfigError(problem)
    if cfg.train.lr < LORA_MIN_LR:
        log.warning("model.lora with train.lr=%g: adapters learn little at a full model's rate; docs/lora.md "
                    "measures train.lr=2e-4 (set it with model.lora.rank)", cfg.train.lr)


# Below this, LoRA adapters barely move: docs/lora.md's runs learn at 1e-4 to 2e-4, ten
# times a full fine-tune's rate, which a user adding only model.lora.rank keeps.
LORA_MIN_LR = 1e-4


def task_of(cfg: Config):
    """The run's task, or a ConfigError in one line."""
    try:
        return task_from_config(cfg.task, cfg.seed)
    except (ValueError, OSError) as err:
        line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(line if line.startswith("task.") else f"task: {line}") from None


def absolute_spec(spec: str) -> str:
    """A `file.py:function` spec with the file's path made absolute (every spawned process
    finds it, whatever its working directory); other specs as they are."""
    if ".py:" in spec and not Path(spec.rsplit(":", 1)[0]).is_absolute():
        file, fn = spec.rsplit(":", 1)
        return f"{Path(file).resolve()}:{fn}"
    return spec


def check_task(cfg: Config) -> None:
    """Build the task, its prompt format and its reward as every process will, and call
    the reward on a sample, so that user code and data fail here in one line (exit 2)
    instead of in every spawned process. A reward given as a file path is made absolute."""
    spec = getattr(cfg.task, "reward", None)
    # The spawned processes get the working directory on their path (_child_env); so
    # does this check, also when run as the `async-rl` script (whose path starts at the
    # script's own directory, not the working directory).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if spec:
        cfg.task.reward = spec = absolute_spec(spec)
    if getattr(cfg.task, "name", None) == "dataset":  # every process reads it from the same place
        cfg.task.path = str(Path(cfg.task.path).resolve())
    task = task_of(cfg)
    try:
        prompt_format = prompt_format_for(cfg.model.path, cfg.task, load_tokenizer(cfg.model.path, quick=True))
        samples = [task.train_prompt(0), *task.eval_prompts()[:1]]
        for prompt in samples:
            prompt_format.encode(prompt)
    except (ValueError, OSError) as err:
        raise ConfigError(f"task: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    if cfg.task.chat_template is False and prompt_format.tokenizer.chat_template:
        log.warning("task.chat_template=false, but the tokenizer has a chat template: a chat model usually needs it")
    if spec is None and getattr(cfg.task, "name", None) in ("jsonl", "dataset"):
        if cfg.env is None or cfg.env.name == "calculator":  # the calculator scores final answers by it
            raise ConfigError(f"task.reward: a {cfg.task.name} task needs a reward, unless an environment "
                              "(env.name, not the calculator) scores its episodes")
        samples = []  # the environment scores: the reward is never called
    for prompt in samples:
        for response in (prompt.answer, ""):
            try:
                value = task.reward(prompt.text, response, prompt.answer, **prompt.fields)
            except Exception as err:  # user code: any failure is a config error here
                raise ConfigError(f"task.reward: {spec or 'the task reward'} raised {type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''} on a sample (response "
                                  f"{response!r:.40}, answer {prompt.answer!r:.40})") from None
            try:
                as_outcome(value)  # a float, or StepRewards
            except Failed as failure:
                raise ConfigError(f"task.reward: {spec or 'the task reward'} returned {value!r:.40} on a sample; "
                                  f"a reward must be a finite number ({failure})") from None
    if cfg.env is not None:
        check_environment(cfg, task, prompt_format)
    check_components(cfg)
    check_critic(cfg)


def check_critic(cfg: Config) -> None:
    """train.advantage.critic_init is a reward model the critic can start from: one output,
    and the policy's vocabulary (the critic reads the policy's tokens); else one line."""
    advantage = cfg.train.advantage
    path = getattr(advantage, "critic_init", None)
    if advantage.name != "gae" or path is None:
        return
    from transformers import AutoConfig

    from async_rl.models.critic import reward_head

    where = "train.advantage.critic_init"
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{where}: {path!r} is not a model directory (no config.json)")
    advantage.critic_init = str(Path(path).resolve())
    try:
        reward_head(path, AutoConfig.from_pretrained(path).hidden_size)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    if load_tokenizer(path, quick=True).get_vocab() != load_tokenizer(cfg.model.path, quick=True).get_vocab():
        raise ConfigError(f"{where}: {path} has another vocabulary than model.path: the critic reads the policy's "
                          "tokens")


def check_components(cfg: Config) -> None:
    """Each reward.components entry loads (a reward model's directory exists): else one
    line naming it (exit 2). A file path is made absolute, as task.reward's."""
    from async_rl.tasks import load_reward_fn

    for component in cfg.reward.components:
        where = f"reward.components ({component.name})"
        if component.reward == "judge" and component.model is None:
            continue  # a server: asked when the run scores
        if component.reward in ("reward_model", "prm", "judge"):
            if not (Path(component.model) / "config.json").is_file():
                raise ConfigError(f"{where}: model {component.model!r} is not a model directory (no config.json)")
            component.model = str(Path(component.model).resolve())
        elif component.reward != "task":
            component.reward = absolute_spec(component.reward)
            try:
                load_reward_fn(component.reward)
            except ValueError as err:
                raise ConfigError(f"{where}: {str(err).splitlines()[0]}") from None


def check_environment(cfg: Config, task, prompt_format) -> None:
    """env.name loads, makes an environment for a sample prompt, and the chat template
    lets turns be appended: else one line (exit 2). A file path is made absolute."""
    from async_rl.actor.environments.registry import environment_factory
    from async_rl.actor.rollout.turns import TurnFormat

    cfg.env.name = name = absolute_spec(cfg.env.name)
    try:
        factory = environment_factory(cfg.env.name, task, cfg.env.options, cfg.env.max_turns)
        TurnFormat(prompt_format).text([{"role": "user", "content": "x"}])
    except ValueError as err:
        raise ConfigError(str(err).splitlines()[0] if str(err).startswith("env.name") else f"env.name: {err}") from None
    try:
        env = factory(task.train_prompt(0))
    except Exception as err:  # user code: any failure is a config error here
        first = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError(f"env.name: {name} raised {type(err).__name__}: {first} making the environment of a "
                          f"sample prompt") from None
    if not callable(getattr(env, "step", None)):
        raise ConfigError(f"env.name: {name} made {type(env).__name__}, which has no step(action) method")
