"""Multi-turn environments: an episode is a conversation between the policy and an
environment (tool results, game state), trained as one token-exact sample.

    base      the protocol an environment implements (`Environment.step`, `Turn`)
    guard     user environment code run guarded: failures counted, never fatal
    turns     the tokens an environment's answer adds, in the chat template's format
    episode   one episode's token sequence, loss mask, log-probs, versions and steps
    rollout   many episodes in flight on one engine, environments in worker threads
"""
from .base import Environment, EnvironmentFactory, Turn
from .episode import Episode
from .guard import EnvironmentGuard
from .turns import TurnFormat

__all__ = ["Environment", "EnvironmentFactory", "Episode", "EnvironmentGuard", "Turn", "TurnFormat"]
