"""The built-in word-problem task for chat models."""
import pytest

from async_rl.tasks import EVAL_ID_OFFSET, WordProblemsTask, make_task


def test_prompts_are_deterministic_and_answers_correct():
    task = make_task("word_problems", seed=3, eval_size=64)
    again = WordProblemsTask(seed=3, eval_size=64)
    for i in range(200):
        p = task.train_prompt(i)
        assert p == again.train_prompt(i) and p.id == i and p.text.endswith("Answer with just the number.")
        assert int(p.answer) >= 0
        if p.text.startswith("What is"):  # "What is a + b?" / "What is a - b?"
            expr = p.text[len("What is "):p.text.index("?")]
            assert eval(expr) == int(p.answer)  # noqa: S307 - our own generated text
    assert task.train_prompt(5) != make_task("word_problems", seed=4).train_prompt(5)
    markers = (" + ", " - ", "gets", "gives away", "in all")
    texts = [task.train_prompt(i).text for i in range(200)]
    assert all(any(m in t for t in texts) for m in markers)  # every template occurs


def test_held_out_set_is_fixed_disjoint_and_numbered():
    task = WordProblemsTask(seed=0, eval_size=100)
    held = task.eval_prompts()
    assert len({p.text for p in held}) == 100 and held[0].id == EVAL_ID_OFFSET
    assert held == WordProblemsTask(seed=7, eval_size=100).eval_prompts()  # same for every run seed
    texts = {p.text for p in held}
    assert not any(task.train_prompt(i).text in texts for i in range(3000))


def test_reward_reads_the_last_number_of_a_sentence():
    task = WordProblemsTask(seed=0, eval_size=8)
    assert task.reward("q", "Sam gives away 2 marbles, so 14 - 2 = 12 marbles are left.", "12") == 1.0
    assert task.reward("q", "14 - 2 = 12\n\nThis is a classic example of 3 things.", "12") == 0.0
    with pytest.raises(ValueError, match="max_operand"):
        WordProblemsTask(seed=0, max_operand=1)
