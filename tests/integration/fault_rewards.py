"""Reward functions that misbehave on purpose, for fault-handling tests (loaded by the
actors as `fault_rewards:NAME` through PYTHONPATH)."""


def overflowing(prompt: str, response: str, answer: str) -> float:
    """Finite in float32 but squares to inf: an OPMD loss on it is non-finite."""
    return 1e30 if len(response) % 2 else 0.0


# The rewards below score the launch check's samples (the answer itself, and "") right,
# as a reward that fails only on some model output does, and fail on a fixed share of
# the other responses, counted per process.
_calls = [0]


def _nth_wrong_response(response: str, answer: str) -> int | None:
    """The 1-based count of responses that are neither empty nor the answer; None for those."""
    if not response or response.strip() == answer.strip():
        return None
    _calls[0] += 1
    return _calls[0]


def _exact(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


def raises_sometimes(prompt: str, response: str, answer: str) -> float:
    n = _nth_wrong_response(response, answer)
    if n is not None and n % 5 == 0:
        raise ValueError(f"cannot parse {response!r}")
    return _exact(response, answer)


def nan_sometimes(prompt: str, response: str, answer: str) -> float:
    n = _nth_wrong_response(response, answer)
    return float("nan") if n is not None and n % 5 == 0 else _exact(response, answer)


def none_sometimes(prompt: str, response: str, answer: str):
    n = _nth_wrong_response(response, answer)
    return None if n is not None and n % 5 == 0 else _exact(response, answer)


def sleeps_sometimes(prompt: str, response: str, answer: str) -> float:
    n = _nth_wrong_response(response, answer)
    if n is not None and n % 20 == 0:
        import time

        time.sleep(3600)  # past any reward.timeout_s a test sets
    return _exact(response, answer)


def mixed_faults(prompt: str, response: str, answer: str):
    """About a third of the wrong responses fail: raises, NaN, None in turn, and one
    in 50 hangs."""
    n = _nth_wrong_response(response, answer)
    if n is None:
        return _exact(response, answer)
    if n % 50 == 49:
        import time

        time.sleep(3600)
    return {1: lambda: 1 / 0, 4: lambda: float("nan"), 7: lambda: None}.get(n % 10, lambda: 0.0)()


def broken_on_real_responses(prompt: str, response: str, answer: str) -> float:
    """Right on the launch check's samples, raises on every other response."""
    if _nth_wrong_response(response, answer) is not None:
        raise KeyError("score")
    return _exact(response, answer)
