"""Reward functions that misbehave on purpose, for fault-handling tests (loaded by the
actors as `fault_rewards:NAME` through PYTHONPATH)."""


def overflowing(prompt: str, response: str, answer: str) -> float:
    """Finite in float32 but squares to inf: an OPMD loss on it is non-finite."""
    return 1e30 if len(response) % 2 else 0.0
