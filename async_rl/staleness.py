"""Policy versions and staleness, defined once for the actor, the wire, the hub, the
learner, the metrics and the simulator.

A *version* counts learner steps: the weights after step k are version k (an optimizer
step inside a learner step does not count). Every generated token records the version
of the weights that sampled it (a weight update can land between two decode steps).
A response's, and its prompt group's, version is that of its OLDEST token, so a
group consumed at learner version V has staleness V - version and staleness is never
understated.

The bound (AReaL's admission rule, made exact in coordinator/admission.py): the group with
admission index i is consumed at version floor(i / B) (B = train.batch_groups), so
admitting it to an actor at version v only while i < (eta + v + 1) * B keeps every
staleness <= eta = max_staleness.
"""
from __future__ import annotations

import numpy as np


def group_version(token_versions: np.ndarray, default: int, policy_mask: np.ndarray | None = None) -> int:
    """The version of a group's oldest policy token (`token_versions`: all its responses'
    tokens, flat; `policy_mask`, when not empty: 1 where the policy sampled the token, 0
    where an environment wrote it); `default` (the generating weights) when no response
    has a policy token."""
    if policy_mask is not None and len(policy_mask):
        token_versions = token_versions[np.asarray(policy_mask, dtype=bool)]
    return int(token_versions.min()) if token_versions.size else int(default)


def staleness(learner_version: int, version: int) -> int:
    """Versions between the weights that generated a sample and those it trains."""
    return learner_version - version


def consumed_at(index: int, batch_groups: int) -> int:
    """Learner version at which the group with admission index `index` is consumed."""
    return index // batch_groups


def admission_limit(max_staleness: int, actor_version: int, batch_groups: int) -> int:
    """Admission indices below this may go to an actor holding weights of `actor_version`."""
    return (max_staleness + actor_version + 1) * batch_groups
