"""tasks/reasoning_gym_adapter.py on the real reasoning-gym package: prompts are a pure
function of (seed, index), training never poses a held-out question, and the reward is
the dataset's own score_answer on the entry the prompt came from."""
import json

import pytest

rg = pytest.importorskip("reasoning_gym")

from async_rl.config import ConfigError, load_config  # noqa: E402
from async_rl.tasks import EVAL_ID_OFFSET, make_task  # noqa: E402


def _answer(prompt) -> str:
    return json.loads(prompt.answer)["answer"]


def test_prompts_are_reasoning_gyms_questions_with_its_system_prompt():
    task = make_task("reasoning_gym", seed=3, dataset="leg_counting", eval_size=8)
    again = make_task("reasoning_gym", seed=3, dataset="leg_counting", eval_size=8)
    other_seed = make_task("reasoning_gym", seed=4, dataset="leg_counting", eval_size=8)
    p = task.train_prompt(5)
    assert p.id == 5 and p == again.train_prompt(5) and p.text != other_seed.train_prompt(5).text
    assert p.messages == (("system", rg.utils.SYSTEM_PROMPTS["default"]), ("user", p.text))
    assert "how many legs" in p.text and _answer(p).isdigit()
    held_out = task.eval_prompts()
    assert [q.id for q in held_out] == [EVAL_ID_OFFSET + k for k in range(8)]
    assert held_out == other_seed.eval_prompts()  # the held-out set does not depend on the run's seed
    own = make_task("reasoning_gym", seed=3, dataset="leg_counting", eval_size=8, system_prompt="Be brief.")
    assert own.train_prompt(5).messages[0] == ("system", "Be brief.")


def test_training_never_poses_a_held_out_question():
    # Two one-digit terms: a few hundred distinct questions, so the pools overlap.
    options = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    task = make_task("reasoning_gym", seed=0, dataset="basic_arithmetic", options=options, eval_size=64)
    held_out = {p.text for p in task.eval_prompts()}
    train = [task.train_prompt(i).text for i in range(600)]
    assert len(set(train)) > 100 and not held_out & set(train)


def test_the_reward_is_the_datasets_score_answer_on_the_entry():
    task = make_task("reasoning_gym", seed=1, dataset="leg_counting", eval_size=4)
    p = task.train_prompt(2)
    where = json.loads(p.answer)
    # The same entry, made by reasoning-gym itself from the seed and index the adapter uses.
    dataset = rg.create_dataset("leg_counting", seed=1 << 24, size=10_000)
    entry = dataset[where["index"]]
    assert entry["question"] == p.text and entry["answer"] == _answer(p)
    right, wrong = f"Counting... <answer>{entry['answer']}</answer>", "<answer>3</answer>"
    assert task.reward(p.text, right, p.answer) == dataset.score_answer(entry["answer"], entry) == 1.0
    assert task.reward(p.text, wrong, p.answer) == dataset.score_answer("3", entry) == 0.0
    assert task.reward(p.text, entry["answer"], p.answer) == 0.0  # no <answer> tags: reasoning-gym's format
    q = task.eval_prompts()[1]
    assert task.reward(q.text, f"<answer>{_answer(q)}</answer>", q.answer) == 1.0


def test_a_partial_credit_scorer_reads_the_entrys_metadata():
    # word_sorting's score_answer compares lists it parses, using the entry's metadata.
    task = make_task("reasoning_gym", seed=0, dataset="word_sorting", eval_size=4)
    p = task.train_prompt(0)
    dataset = rg.create_dataset("word_sorting", seed=0, size=10_000)
    entry = dataset[json.loads(p.answer)["index"]]
    response = "<answer>" + ", ".join(reversed(entry["metadata"]["sorted_words"])) + "</answer>"
    expected = dataset.score_answer(", ".join(reversed(entry["metadata"]["sorted_words"])), entry)
    assert 0.0 < expected < 1.0 and task.reward(p.text, response, p.answer) == expected


@pytest.mark.parametrize("options, message", [
    ({"dataset": "no_such_dataset"}, "task.dataset: reasoning-gym has no dataset 'no_such_dataset'"),
    ({"dataset": "leg_counting", "options": {"legs": 3}}, "task.dataset_options: reasoning-gym's leg_counting refused"),
    ({"dataset": "leg_counting", "options": {"min_animals": 5, "max_animals": 2}},
     "max_animals must be >= min_animals"),
    ({"dataset": "leg_counting", "options": {"seed": 1}}, "task.dataset_options.seed"),
])
def test_bad_datasets_and_options_are_one_line(options, message):
    with pytest.raises(ValueError, match=message) as err:
        make_task("reasoning_gym", seed=0, **options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, key", [
    (["task.name=reasoning_gym"], "task.dataset: required"),
    (["task.name=reasoning_gym", "task.dataset=leg_counting", "task.reward=exact_match"],
     "task.reward: unknown key for task.name=reasoning_gym"),
])
def test_config_refuses_what_the_task_cannot_use(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)
