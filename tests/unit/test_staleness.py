"""The version and staleness rules of async_rl/staleness.py, on hand-computed cases."""
import numpy as np

from async_rl.staleness import admission_limit, consumed_at, group_version, staleness


def test_group_version_is_the_oldest_token():
    versions = np.array([5, 4] + [6, 6, 6], np.int32)  # two responses, end to end
    assert group_version(versions, default=9) == 4
    assert group_version(np.zeros(0, np.int32), default=9) == 9  # no token at all


def test_the_admission_limit_bounds_staleness_by_eta():
    # eta = 1, B = 4: an actor at version 0 may take indices 0..7, consumed at versions 0..1.
    assert admission_limit(1, 0, 4) == 8
    assert consumed_at(7, 4) == 1 and consumed_at(8, 4) == 2
    for eta in range(4):
        for v in range(5):
            last = admission_limit(eta, v, 4) - 1
            assert staleness(consumed_at(last, 4), v) == eta
