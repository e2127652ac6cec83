"""Built-in verifiable rewards on real-looking model outputs, and reward specs."""
import signal
import sys
import threading

import pytest

from async_rl.tasks import exact_match, load_reward_fn
from async_rl.tasks.code_rewards import code_tests, code_tests_all_pass
from async_rl.tasks.rewards import (
    BUILTIN_REWARDS,
    boxed,
    gsm8k,
    last_boxed,
    last_number,
    math_verify,
    numbers_equal,
    parse_number,
)

# ---------------------------------------------------------------- numbers


@pytest.mark.parametrize(("text", "value"), [
    ("12", 12.0), ("-7", -7.0), ("\u22127", -7.0), ("+5", 5.0), ("3.50", 3.5), (".5", 0.5),
    ("1,234", 1234.0), ("1,234.50", 1234.5), ("1{,}000", 1000.0), ("10,\\!000", 10000.0),
    ("$5.", 5.0), ("-$5", -5.0), ("\\$18.90", 18.9), ("50%", 50.0), ("50\\%", 50.0),
    ("12 apples", 12.0), ("18.90 dollars", 18.9), ("5\\text{ cm}", 5.0), ("90^\\circ", 90.0),
    ("3/4", 0.75), ("\\frac{3}{4}", 0.75), ("\\dfrac{-1}{2}", -0.5), ("\\frac12", 0.5), ("\\(12\\)", 12.0),
])
def test_parse_number_reads_numbers_as_written(text, value):
    assert parse_number(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["abc", "", "3 + 4", "2 \\sqrt{3}", "2x", "x = 2", "1,23", "1/0", "1.2.3"])
def test_parse_number_rejects_what_is_not_one_number(text):
    assert parse_number(text) is None


def test_numbers_equal_uses_a_small_relative_tolerance():
    assert numbers_equal(1e9, 1e9 + 100) and numbers_equal(0.0, 1e-9)
    assert not numbers_equal(1e9, 1e9 + 1e4) and not numbers_equal(0.5, 0.5001)
    assert not numbers_equal(None, 1.0) and not numbers_equal(None, None)


# ---------------------------------------------------------------- last_number


@pytest.mark.parametrize(("response", "answer", "expected"), [
    ("Sam gives away 2 marbles, so 14 - 2 = 12 marbles are left.", "12", 1.0),  # SmolLM2's style
    ("12.0", "12", 1.0),
    ("The answer is 12.", "12.0", 1.0),
    ("The answer is $1,234.", "1234", 1.0),
    ("1234", "1,234", 1.0),
    ("**Answer:** 42", "42", 1.0),
    ("It is \\(12\\).", "12", 1.0),
    ("The temperature is -7 degrees", "-7", 1.0),
    ("Each box holds 12apples", "12", 1.0),  # glued to a word
    ("That leaves 12% of the class", "12", 1.0),
    ("3/4 of the pizza", "0.75", 1.0),
    ("That is \\frac{1}{2}", "0.5", 1.0),
    ("it costs $12", "$12.00", 1.0),
    ("So 10,\\!000 ways.", "10000", 1.0),
    ("The pages go from 5-7", "7", 1.0),  # a hyphen between numbers is no sign
    ("x = 5, so -x = -5", "-5", 1.0),
    # By design the LAST number counts: an answer followed by rambling with numbers scores 0.
    ("7 + 17 = 24\n\nThis is one of 3 classic examples.", "24", 0.0),
    ("16 - 10 = 10", "6", 0.0),
    ("The answer is 12.", "-12", 0.0),
    ("3.5", "35", 0.0),
    ("I don't know.", "5", 0.0),
])
def test_last_number(response, answer, expected):
    assert last_number("q", response, answer) == expected


def test_last_number_with_a_non_numeric_answer_compares_the_number_text():
    assert last_number("q", "The code is 12", "twelve") == 0.0
    assert last_number("q", "That is 1/0", "1/0") == 1.0  # no value, the same text
    assert last_number("q", "That is 2/0", "1/0") == 0.0


# ---------------------------------------------------------------- boxed


@pytest.mark.parametrize(("text", "content"), [
    ("So \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{3} or rather \\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),
    ("\\boxed{a^{b^{c}}}", "a^{b^{c}}"),
    ("$\\fbox{7}$", "7"),
    ("\\boxed 5$ done", "5"),
    ("no box here", None),
    ("\\boxed{\\frac{1}{2}", None),  # cut inside the box
])
def test_last_boxed_extracts_balanced_content(text, content):
    assert last_boxed(text) == content


@pytest.mark.parametrize(("response", "answer", "expected"), [
    ("So the result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("So the result is \\boxed{\\frac{1}{2}}.", "1/2", 1.0),
    ("\\boxed{1/2}", "\\frac12", 1.0),
    ("\\boxed{\\dfrac{\\pi}{2}}", "\\frac{\\pi}{2}", 1.0),
    ("first \\boxed{3}, then corrected: \\boxed{4}", "4", 1.0),
    ("\\boxed{x + 1}", "x+1", 1.0),
    ("\\boxed{x^{2}}", "x^2", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{\\text{(A)}}", "(A)", 1.0),
    ("\\boxed{\\$18.90}", "18.9", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\fbox{7}", "\\boxed{7}", 1.0),  # a boxed gold answer compares by its content
    ("\\boxed{7}", "The sum is 3 + 4 = \\boxed{7}.", 1.0),  # a full MATH solution as the answer
    ("\\boxed{3}", "4", 0.0),
    ("\\boxed{3 + 4}", "3", 0.0),  # not a number: compared as text
    ("\\boxed{2\\sqrt{3}}", "2", 0.0),
    ("the answer is 4", "4", 0.0),  # no box, no reward
    ("\\boxed{\\frac{1}{2}", "0.5", 0.0),  # cut inside the box
])
def test_boxed(response, answer, expected):
    assert boxed("q", response, answer) == expected


# ---------------------------------------------------------------- gsm8k

SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"


@pytest.mark.parametrize(("response", "answer", "expected"), [
    ("She sold 48 + 24 = 72 clips.\n#### 72", SOLUTION, 1.0),
    ("48 + 24 = 72\n#### 72", "72", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### $72.", "72", 1.0),
    ("#### 72 clips", SOLUTION, 1.0),
    ("#### 5\nWait, no.\n#### 72", SOLUTION, 1.0),  # the last ####
    ("#### 72", "#### 72\n\nSource: GSM8K", 1.0),
    ("#### 71", SOLUTION, 0.0),
    ("#### 72\nWait, no.\n#### 5", SOLUTION, 0.0),
    ("The answer is 72", SOLUTION, 0.0),  # strict: no ####, no reward
    ("72", "72", 0.0),
    ("####", "72", 0.0),
])
def test_gsm8k(response, answer, expected):
    assert gsm8k("q", response, answer) == expected


# ---------------------------------------------------------------- math_verify


@pytest.mark.parametrize(("response", "answer", "expected"), [
    ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
    ("The answer is 0.5", "\\frac{1}{2}", 1.0),
    ("so $\\sqrt{2}/2$", "\\frac{\\sqrt{2}}{2}", 1.0),  # a bare LaTeX gold answer
    ("so \\boxed{\\frac{\\sqrt{2}}{2}}", "$\\sqrt{2}/2$", 1.0),
    ("$x = 2$", "2", 1.0),
    ("I think 2, but finally \\boxed{3}", "3", 1.0),
    ("\\boxed{18.90}", "\\$18.90", 1.0),
    ("$3$", "2", 0.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{2}}{2}", 0.0),
    ("I don't know", "2", 0.0),
])
def test_math_verify_symbolic_equivalence(response, answer, expected):
    pytest.importorskip("math_verify")
    assert math_verify("q", response, answer) == expected


def test_math_verify_runs_in_a_worker_thread():
    # math-verify's default timeout uses signal.alarm, which raises outside the main thread.
    pytest.importorskip("math_verify")
    results = []

    def score():
        try:
            results.append(math_verify("q", "$\\frac{1}{2}$", "0.5"))
        except Exception as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    worker = threading.Thread(target=score)
    worker.start()
    worker.join(60)
    assert results == [1.0]


def test_math_verify_keeps_a_timer_armed_by_someone_else():
    pytest.importorskip("math_verify")
    remaining, interval = signal.setitimer(signal.ITIMER_REAL, 0)  # pytest-timeout's, if any
    try:
        # No timer: math-verify's alarm is used, and cancelled when it is done.
        assert math_verify("q", "$2$", "2") == 1.0
        assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
        signal.setitimer(signal.ITIMER_REAL, 600)  # someone's timer: it must survive the call
        assert math_verify("q", "$2$", "2") == 1.0
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 600
    finally:
        signal.setitimer(signal.ITIMER_REAL, remaining, interval)


def test_math_verify_without_the_library_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install 'async-rl\[math\]'"):
        math_verify("q", "2", "2")


# ---------------------------------------------------------------- reward specs


def test_builtin_rewards_are_the_functions():
    assert BUILTIN_REWARDS == {"exact_match": exact_match, "last_number": last_number, "boxed": boxed,
                               "gsm8k": gsm8k, "math_verify": math_verify, "code_tests": code_tests,
                               "code_tests_all_pass": code_tests_all_pass}
    for name, fn in BUILTIN_REWARDS.items():
        assert load_reward_fn(name) is fn
    assert load_reward_fn(" gsm8k ") is gsm8k


def test_reward_spec_module_function():
    assert load_reward_fn("async_rl.tasks.rewards:boxed") is boxed
    method = load_reward_fn("async_rl.tasks.arithmetic:ArithmeticTask.reward")  # dotted attribute
    assert method(None, "q", "82", "82") == 1.0


def test_reward_spec_file(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    # A dataclass with string annotations needs its module in sys.modules.
    (tmp_path / "sub" / "my_rewards.py").write_text(
        "from __future__ import annotations\nfrom dataclasses import dataclass\n\n\n@dataclass\nclass Score:\n"
        "    value: float = 0.25\n\n\ndef score(prompt, response, answer):\n    return Score().value\n")
    monkeypatch.chdir(tmp_path)
    assert load_reward_fn("sub/my_rewards.py:score")("p", "r", "a") == 0.25
    absolute = load_reward_fn(f"{tmp_path / 'sub' / 'my_rewards.py'}:score")
    assert absolute("p", "r", "a") == 0.25 and absolute.__name__ == "score"


@pytest.mark.parametrize(("spec", "files", "needle"), [
    ("nowhere_module_xyz:f", {}, "no module named 'nowhere_module_xyz'; it must be importable from the working "
                                 "directory or installed, or give a file: 'path/to/rewards.py:fn'"),
    ("nowhere_module_xyz.sub:f", {}, "no module named 'nowhere_module_xyz'; it must be importable"),
    ("imports_missing:f", {"imports_missing.py": "import nowhere_module_xyz\n"},
     "module 'imports_missing' failed to import (ModuleNotFoundError: No module named 'nowhere_module_xyz')"),
    ("nowhere_ext:f", {"nowhere_ext.py": "import nowhere\n"},  # a missing import that prefixes the name
     "module 'nowhere_ext' failed to import (ModuleNotFoundError: No module named 'nowhere')"),
    ("bad_syntax_mod:f", {"bad_syntax_mod.py": "x = 1\ndef f(:\n"},
     "module 'bad_syntax_mod' failed to import (SyntaxError: invalid syntax, line 2)"),
    ("name_error_mod:f", {"name_error_mod.py": "undefined_name + 1\n"},
     "module 'name_error_mod' failed to import (NameError: name 'undefined_name' is not defined)"),
    ("broken.py:f", {"broken.py": "x = 1\n\ndef f(:\n"},
     "cannot load file broken.py (SyntaxError: invalid syntax, line 3)"),
    ("raising.py:f", {"raising.py": "import nowhere_module_xyz\n"},
     "cannot load file raising.py (ModuleNotFoundError: No module named 'nowhere_module_xyz')"),
    ("multiline.py:f", {"multiline.py": "raise RuntimeError('first line\\nsecond line')\n"},
     "cannot load file multiline.py (RuntimeError: first line)"),
    ("exits.py:f", {"exits.py": "import sys\nsys.exit(3)\n"}, "cannot load file exits.py (SystemExit: 3)"),
    ("ok.py:g", {"ok.py": "def f(p, r, a):\n    return 1\n"}, "'ok.py' has no attribute 'g'"),
    ("ok.py:X", {"ok.py": "X = 3\n"}, "'X' is not callable"),
    ("missing.py:f", {}, "no file missing.py in "),
    ("last_numbers", {}, "must be a built-in name (exact_match, last_number, boxed, gsm8k, math_verify, code_tests, "
                         "code_tests_all_pass)"),
    ("async_rl.tasks.rewards:", {}, "must look like 'module:function'"),
])
def test_bad_reward_specs_are_one_line(tmp_path, monkeypatch, spec, files, needle):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    with pytest.raises(ValueError) as info:
        load_reward_fn(spec)
    message = str(info.value)
    assert message.startswith(f"reward spec {spec!r}") and needle in message and "\n" not in message
