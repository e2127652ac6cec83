"""Every grant ends exactly once: a property test of the coordinator's bookkeeping over random
sequences of requests, deliveries, refused groups (by the coordinator's checks and by the wire
layer), actor deaths and arrivals, and learner steps. After every event each admitted
slot is in exactly one place: consumed, in the buffer, granted to a live actor, or
waiting to be re-issued."""
import random

import numpy as np
import pytest
import torch

from async_rl.config import build_config
from async_rl.coordinator.coordinator import Coordinator
from async_rl.tasks import make_task
from async_rl.weight_transfer.sender import WeightSender
from async_rl.wire import ExperienceGroup, Hello, WorkRequest, encode

G, B = 2, 4


def group(actor_id: int, index: int, prompt_id: int, version: int, logprob: float = -0.5) -> ExperienceGroup:
    return ExperienceGroup(
        actor_id=actor_id, group=index, prompt_id=prompt_id, version=version,
        prompt_tokens=np.array([1, 5], dtype=np.int32), response_tokens=np.full(2 + 1, 4, dtype=np.int32),
        response_lengths=np.array([2, 1], dtype=np.int32), logprobs=np.full(2 + 1, logprob, dtype=np.float32),
        token_versions=np.full(2 + 1, version, dtype=np.int32), rewards=np.array([1.0, 0.0], dtype=np.float32),
        truncated=np.zeros(G, np.uint8), gen_seconds=0.1)


@pytest.mark.parametrize("seed", range(6))
def test_every_admitted_slot_is_in_exactly_one_place(tmp_path, seed):
    rng = random.Random(seed)
    cfg = build_config({"max_staleness": 1, "learner": {"ranks": 1},
                        "train": {"batch_groups": B, "group_size": G}, "actors": {"groups_per_request": 3}})
    task = make_task("arithmetic", seed=0)
    bc = WeightSender([("w", (4,), torch.float32)], bucket_mb=1, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=5)
    coord = Coordinator(cfg, task, bc, tmp_path)  # not started: the test hands it the hub's messages
    consumed: list[int] = []
    identities: dict[int, bytes] = {}

    def join() -> None:
        identity = rng.randbytes(8)
        before = set(coord.actors)
        coord.on_request(identity, -1, Hello(actor_name="a", pid=1, host="h"))
        (new,) = set(coord.actors) - before
        identities[new] = identity

    def check() -> None:
        buffered = [i for i, _, _ in coord.buffer.contents()]
        places = consumed + buffered + list(coord.granted) + list(coord.reissue)
        assert sorted(places) == list(range(coord.admission.admitted)), "a slot is lost or held twice"
        for index, grant in coord.granted.items():
            assert grant.actor_id in coord.actors and index in coord.actors[grant.actor_id].outstanding

    try:
        join()
        for _ in range(600):
            event = rng.random()
            live = sorted(coord.actors)
            outstanding = [(a, i) for a in live for i in sorted(coord.actors[a].outstanding)]
            if not live or event < 0.05:
                join()
            elif event < 0.35:
                actor = rng.choice(live)
                coord.on_request(identities[actor], -1, WorkRequest(actor_id=actor, version=coord.version,
                                                                    max_groups=rng.randint(1, 3)))
            elif event < 0.65 and outstanding:
                actor, index = rng.choice(outstanding)
                version = coord.granted[index].version
                prompt = coord.granted[index].prompt_id
                fault, grant = rng.random(), coord.granted[index]
                if fault < 0.7:
                    coord.on_experience(group(actor, index, prompt, version))
                elif fault < 0.8:  # refused by the hub: a version it never handed out
                    coord.on_experience(group(actor, index, prompt, coord.version + 1))
                elif fault < 0.9:  # refused by the wire layer (NaN log-prob), header intact
                    coord.on_rejected_group(encode(group(actor, index, prompt, version, logprob=float("nan"))))
                else:  # a forged claim on another actor's grant changes nothing
                    coord.on_rejected_group(encode(group(actor + 100, index, prompt, version)))
                    assert coord.granted[index] is grant
                if fault < 0.9:  # this grant ended: consumed, or handed back for another try
                    assert coord.granted.get(index) is not grant
            elif event < 0.75 and live:
                coord._remove(rng.choice(live), "killed")
            else:
                taken = coord.take(B, coord.version, timeout=0)
                if taken is not None:
                    consumed.extend([*taken.indices, *taken.dropped_indices])
                    coord.advance(coord.version + 1)
            check()
        assert coord.version > 5 and coord.rejects.by_reason().get("bad_version", 0) > 0
    finally:
        bc.close()
