"""Built-in rewards on real-looking model outputs, and reward specs."""
import pytest

from async_rl.tasks import load_reward_fn
from async_rl.tasks.rewards import boxed, gsm8k, last_number, math_verify, parse_number


@pytest.mark.parametrize(("response", "answer", "expected"), [
    ("Sam gives away 2 marbles, so 14 - 2 = 12 marbles are left.", "12", 1.0),  # SmolLM2's style
    ("12", "12", 1.0),
    ("12.0", "12", 1.0),
    ("The answer is $1,234.", "1234", 1.0),
    ("1234", "1,234", 1.0),
    ("**Answer:** 42", "42", 1.0),
    ("It is \\(12\\).", "12", 1.0),
    ("-7 degrees", "-7", 1.0),
    ("3/4 of the pizza", "0.75", 1.0),
    ("That is \\frac{1}{2}", "0.5", 1.0),
    ("it costs $12", "12.00", 1.0),
    # By design the LAST number counts: an answer followed by rambling with numbers scores 0.
    ("7 + 17 = 24\n\nThis is one of 3 classic examples.", "24", 0.0),
    ("16 - 10 = 10", "6", 0.0),
    ("I don't know.", "5", 0.0),
])
def test_last_number(response, answer, expected):
    assert last_number("q", response, answer) == expected


def test_last_number_with_a_non_numeric_answer_compares_text():
    assert last_number("q", "room 12B, floor 3", "3") == 1.0
    assert last_number("q", "version 2", "two") == 0.0


@pytest.mark.parametrize(("response", "answer", "expected"), [
    ("So the result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("\\boxed{1/2}", "\\frac12", 1.0),
    ("first \\boxed{3}, then corrected: \\boxed{4}", "4", 1.0),
    ("\\boxed{x + 1}", "x+1", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\fbox{7}", "\\boxed{7}", 1.0),  # a boxed gold answer compares by its content
    ("the answer is 4", "4", 0.0),  # no box, no reward
    ("\\boxed{\\frac{1}{2}", "0.5", 0.0),  # cut inside the box
])
def test_boxed(response, answer, expected):
    assert boxed("q", response, answer) == expected


def test_gsm8k_reads_the_number_after_the_last_hashes():
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"
    assert gsm8k("q", "48 + 24 = 72 clips.\n#### 72", solution) == 1.0
    assert gsm8k("q", "#### 1,000", "1000") == 1.0
    assert gsm8k("q", "#### 71", solution) == 0.0
    assert gsm8k("q", "The answer is 72", solution) == 0.0  # strict: no ####, no reward


def test_math_verify_symbolic_equivalence():
    pytest.importorskip("math_verify")
    assert math_verify("q", "The answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert math_verify("q", "so $\\sqrt{2}/2$", "\\frac{\\sqrt{2}}{2}") == 1.0
    assert math_verify("q", "$x = 2$", "2") == 1.0
    assert math_verify("q", "$3$", "2") == 0.0


def test_parse_number():
    assert parse_number("1,234.50") == 1234.5 and parse_number("$5.") == 5 and parse_number("50%") == 50
    assert parse_number("\\frac{3}{4}") == 0.75 and parse_number("abc") is None


def test_reward_specs(tmp_path, monkeypatch):
    assert load_reward_fn("last_number") is last_number
    assert load_reward_fn("async_rl.tasks.rewards:boxed") is boxed
    (tmp_path / "my_rewards.py").write_text("def score(prompt, response, answer):\n    return 0.25\n")
    monkeypatch.chdir(tmp_path)
    assert load_reward_fn("my_rewards.py:score")("p", "r", "a") == 0.25
    assert load_reward_fn(f"{tmp_path / 'my_rewards.py'}:score")("p", "r", "a") == 0.25


@pytest.mark.parametrize(("spec", "content", "needle"), [
    ("nowhere_module_xyz:f", None, "no module named 'nowhere_module_xyz'; it must be importable"),
    ("broken.py:f", "def f(:\n", "cannot load file broken.py (SyntaxError"),
    ("raising.py:f", "import nowhere_module_xyz\n", "cannot load file raising.py (ModuleNotFoundError"),
    ("ok.py:g", "def f(p, r, a):\n    return 1\n", "has no attribute 'g'"),
    ("missing.py:f", None, "no file missing.py"),
    ("last_numbers", None, "must be a built-in name"),
])
def test_bad_reward_specs_are_one_line(tmp_path, monkeypatch, spec, content, needle):
    monkeypatch.chdir(tmp_path)
    if content is not None:
        (tmp_path / spec.split(":")[0]).write_text(content)
    with pytest.raises(ValueError) as info:
        load_reward_fn(spec)
    assert needle in str(info.value) and "\n" not in str(info.value)
