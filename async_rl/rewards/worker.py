"""A reward worker: `python -m async_rl.rewards.worker IN_FD OUT_FD`, started by the
actor's RewardPool. It builds the reward from the first message (the task section
and the seed), says it is ready, then scores one request at a time, in its main thread,
so that a reward may time itself out with signal.alarm (math-verify does). It dies with
the actor (PR_SET_PDEATHSIG) and exits when the actor closes its pipe; a call past its
deadline is not its business: the actor kills it. Requests come in batches, answers
one call at a time, or BATCH at a time when a component scores batches (a reward model):
the deadline of the first of those then covers the batch.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import traceback

from async_rl.rewards import frames
from async_rl.rewards.components import Components, ComponentScores, components_from_config
from async_rl.rewards.outcome import Failed, StepRewards, as_outcome, failure_note

_PR_SET_PDEATHSIG = 1
TRACEBACK_CHARS = 4000
BATCH = 8  # calls scored at once when a reward.components entry scores batches (a reward model)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed pipe still ends the loop
        pass


def _build(hello: dict):
    """(what scores a training call: the task's reward, or reward.components; the task's reward)"""
    from pydantic import TypeAdapter

    from async_rl.tasks import reward_from_config
    from async_rl.tasks.config import TaskConfig

    reward = reward_from_config(TypeAdapter(TaskConfig).validate_python(hello["task"]), int(hello["seed"]))
    if hello.get("components"):
        return components_from_config(hello["components"], reward, float(hello.get("timeout_s", 10.0))), reward
    return reward, reward


def _score(reward, request: dict) -> dict:
    start = time.perf_counter()
    try:
        if isinstance(request["response"], list):  # a group, for a group-scope component
            scores = reward.score_group(request["prompt"], request["response"], request["answer"], **request["fields"])
            reply: dict = {"group": [scored.reply() for scored in scores]}
        else:
            value = reward(request["prompt"], request["response"], request["answer"], **request["fields"])
            reply = value.reply() if isinstance(value, ComponentScores) else _reply(as_outcome(value))
    except Failed as failure:
        reply = {"failure": failure.reason, "note": failure_note(failure)}
    except Exception as err:
        reply = {"failure": "raised", "note": failure_note(Failed("raised", f"raised {type(err).__name__}: {err}")),
                 "traceback": traceback.format_exc()[-TRACEBACK_CHARS:]}
    reply["id"], reply["seconds"] = request["id"], time.perf_counter() - start
    return reply


def _reply(outcome: float | StepRewards) -> dict:
    if isinstance(outcome, StepRewards):
        return {"value": outcome.value, "steps": [list(step) for step in outcome.steps]}
    return {"value": outcome}


def _score_batch(reward: Components, calls: list[dict]) -> list[dict]:
    start = time.perf_counter()
    scores = reward.score_batch([(c["prompt"], c["response"], c["answer"], c["fields"]) for c in calls])
    seconds = (time.perf_counter() - start) / len(calls)
    return [{**scored.reply(), "id": call["id"], "seconds": seconds} for scored, call in zip(scores, calls)]


def main(argv: list[str]) -> int:
    _die_with_parent()
    read_fd, write_fd = int(argv[0]), int(argv[1])
    os.dup2(2, 1)  # a reward that prints writes to the actor's log, not into the replies
    requests = frames.FrameReader(read_fd)
    hello = requests.next()
    if hello is None:
        return 0
    try:
        reward, task_reward = _build(hello)
    except BaseException as err:  # an import error, a bad spec: the pool reports it once
        frames.write(write_fd, frames.encode({"ready": False, "error": f"{type(err).__name__}: {err}"[:1000]}))
        return 1
    frames.write(write_fd, frames.encode({"ready": True}))
    batched = isinstance(reward, Components) and reward.batched and not reward.grouped  # a group is a batch
    if batched:
        import torch

        torch.set_num_threads(1)  # one core per worker, as any reward gets
    while (batch := requests.next()) is not None:
        calls = batch["calls"]
        if not batched or any(call.get("task_only") for call in calls):
            for call in calls:  # answered one by one: the actor times each call from the last answer
                # An evaluation's call scores the task's own reward, the held-out truth.
                scorer = task_reward if call.get("task_only") else reward
                frames.write(write_fd, frames.encode(_score(scorer, call)))
            continue
        for start in range(0, len(calls), BATCH):  # a reward model scores BATCH calls at once
            for reply in _score_batch(reward, calls[start:start + BATCH]):
                frames.write(write_fd, frames.encode(reply))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # the actor has gone: nobody to answer
        sys.exit(0)
