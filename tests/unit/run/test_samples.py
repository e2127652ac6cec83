"""run/samples.py: whole samples of a batch as samples.jsonl lines, and the lines a
resumed run writes again dropped."""
import json

import numpy as np

from async_rl.run.samples import SAMPLES_FILE, sample_records, truncate_samples
from async_rl.wire.messages import ExperienceGroup, Response


class Display:
    def display(self, tokens, truncated):
        return " ".join(map(str, tokens)) + (" [cut]" if truncated else "")


def test_each_response_with_its_mask_log_probs_versions_and_step_rewards():
    two_turns = Response(np.array([5, 6, 90, 91, 7]), np.array([-0.1, -0.2, 0, 0, -0.3]), np.array([3, 3, 3, 3, 4]),
                         np.array([1, 1, 0, 0, 1], np.uint8), np.array([1, 4]), np.array([0.5, 1.0], np.float32))
    one_turn = Response(np.array([8]), np.array([-0.5]), np.array([4]), np.array([1], np.uint8))
    group = ExperienceGroup.from_responses([two_turns, one_turn], actor_id=2, group=0, prompt_id=11, version=3,
                                           prompt_tokens=np.array([1, 2], np.int32),
                                           rewards=np.array([1.5, 0.0], np.float32),
                                           truncated=np.array([0, 1], np.uint8), gen_seconds=0.0)
    first, second = sample_records([group, group], Display(), step=7, count=3)[:2]
    assert len(sample_records([group, group], Display(), step=7, count=3)) == 3
    assert first == {"step": 7, "prompt_id": 11, "sample": 0, "actor_id": 2, "version": 3, "reward": 1.5,
                     "truncated": False, "prompt_ids": [1, 2], "response_ids": [5, 6, 90, 91, 7],
                     "policy_mask": [1, 1, 0, 0, 1], "logprobs": [-0.1, -0.2, 0.0, 0.0, -0.3],
                     "token_versions": [3, 3, 3, 3, 4], "step_ends": [1, 4], "step_rewards": [0.5, 1.0],
                     "prompt_text": "1 2", "response_text": "5 6 90 91 7"}
    assert second["sample"] == 1 and second["response_text"] == "8 [cut]" and second["step_ends"] == []


def test_a_resumed_run_drops_the_later_steps_and_a_half_written_line(tmp_path):
    lines = [json.dumps({"step": s}) for s in (1, 2, 3, 4)]
    (tmp_path / SAMPLES_FILE).write_text("\n".join(lines) + '\n{"step": 5, "resp')
    truncate_samples(tmp_path, 2)
    assert [json.loads(line)["step"] for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()] == [1, 2]
