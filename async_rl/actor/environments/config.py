"""The env section: multi-turn episodes. Absent (null): single-turn, prompt -> response."""
from __future__ import annotations

from typing import Any

from pydantic import Field

from async_rl.config.section import Section


class EnvConfig(Section):
    name: str = Field(description="`calculator`, `python`, `skyrl_gym/<id>`, or a factory `module:function` / `path/file.py:function`.")
    max_turns: int = Field(4, ge=1, description="Policy turns per episode; an episode still going after them ends truncated.")
    max_tokens: int = Field(256, ge=1, description="Tokens of an episode after its prompt (policy's and environment's).")
    turn_tokens: int | None = Field(None, ge=1, description="New tokens per policy turn (null = actors.max_new_tokens).")
    timeout_s: float = Field(10.0, gt=0.0, description="An environment call running longer fails its episode (reward.on_failure says what becomes of it).")
    options: dict[str, Any] = Field(default_factory=dict, description="`python`: timeout_s, memory_mb, max_output_chars of its sandbox; `skyrl_gym/<id>`: the environment's env_config.")
