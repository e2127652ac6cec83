"""skyrl-gym's text environments (`pip install 'async-rl[skyrl]'`), run unchanged:
`env.name: skyrl_gym/<id>`, e.g. `skyrl_gym/gsm8k_multi_turn`.

An episode calls the environment as SkyRL's generator does: `skyrl_gym.make(id,
env_config=env.options, extras=row)`, `init(prompt)`, then `step(action)` once per
policy turn, whose `observations` (chat messages), `reward` and `done` become a Turn,
and `close()` at the end. The row's `extras` are those of SkyRL's dataset format, made
from the task's prompt: `reward_spec.ground_truth` = the prompt's answer, `max_turns` =
`env.max_turns`, an empty `extra_info`, and over them the prompt's fields (the
dataset's other columns: a row's own `reward_spec`, `extra_info`, `reward_model`,
`db_id`, as SkyRL's datasets carry them).

Not carried over: an `init` that rewrites the prompt (the episode's prompt is the task's,
tokenized once for the whole group; such an environment fails its episodes, counted),
and a step's `postprocessed_action` (the policy's tokens are kept as sampled, so the
learner scores exactly what was generated).
"""
from __future__ import annotations

from async_rl.actor.environments.base import EnvironmentFactory, Turn
from async_rl.tasks.base import Prompt

PREFIX = "skyrl_gym/"


class SkyRLEnvironment:
    """One skyrl-gym environment as an async-rl Environment."""

    def __init__(self, env) -> None:
        self.env = env

    def step(self, action: str) -> Turn:
        out = self.env.step(action)
        return Turn(list(out.get("observations") or []), out.get("reward"), bool(out.get("done")))

    def close(self) -> None:
        self.env.close()


def skyrl_factory(name: str, options: dict, max_turns: int) -> EnvironmentFactory:
    """The factory of `env.name` = skyrl_gym/<id>; ValueError in one line when skyrl-gym
    is missing or has no such environment."""
    env_id = name[len(PREFIX):]
    try:
        import skyrl_gym
        from omegaconf import OmegaConf
    except ImportError:
        raise ValueError(f"env.name {name!r} needs the skyrl-gym package: pip install 'async-rl[skyrl]'") from None
    try:
        skyrl_gym.spec(env_id)
    except Exception:  # skyrl-gym raises its own error types, or an import's, for an unknown id
        known = ", ".join(sorted(skyrl_gym.registry))
        raise ValueError(f"env.name {name!r}: skyrl-gym has no environment {env_id!r} (it has {known})") from None
    env_config = OmegaConf.create(dict(options))

    def make(prompt: Prompt) -> SkyRLEnvironment:
        extras = {"reward_spec": {"method": "rule", "ground_truth": prompt.answer}, "extra_info": {},
                  "max_turns": max_turns, **prompt.fields}
        env = SkyRLEnvironment(skyrl_gym.make(env_id, env_config=env_config, extras=extras))
        messages = prompt.conversation()  # without the run's task.system_prompt
        first, _ = env.env.init(messages)
        if first != messages:
            env.close()
            raise ValueError(f"{env_id}.init rewrote the prompt, which async-rl takes from the task as it is")
        return env

    return make
