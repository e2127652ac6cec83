"""Built-in verifiable rewards: `f(prompt, response, answer) -> float`, 1.0 or 0.0.

`response` is the model's decoded response (special tokens removed), `answer` the
dataset's ground truth. Each reads the model's final answer from the response in one
convention and compares it with the answer:

- `exact_match`: the whole response, stripped, equals the answer (the demo task);
- `last_number`: the last number written (chat models answer in a sentence,
  "14 - 2 = 12 marbles are left.", and the last number is what a reader takes as the
  answer; a response that rambles on past its answer is scored on its last number);
- `boxed`: the last `\\boxed{...}` (the MATH dataset's convention, Hendrycks et al. 2021);
- `gsm8k`: the number after the last `####` (GSM8K's convention, Cobbe et al. 2021);
  strict: no `####`, no reward. The answer may be a full GSM8K solution;
- `math_verify`: symbolic equivalence by the `math-verify` library (optional extra
  `async-rl[math]`), for answers like `\\frac{\\sqrt{2}}{2}` vs `\\sqrt{2}/2`;
- `code_tests`, `code_tests_all_pass`: the response's code run against the row's
  `tests` in a sandbox (code_rewards.py); the fraction passed, or 1.0 only for all.

Numbers compare by value: "1,234" = "1234", "3.50" = "3.5", "3/4" = "0.75",
"\\frac{1}{2}" = "0.5", with a relative tolerance of 1e-6.
"""
from __future__ import annotations

import math
import re
import signal
import threading

from async_rl.tasks.arithmetic import exact_match
from async_rl.tasks.base import RewardFn, load_callable
from async_rl.tasks.code_rewards import code_tests, code_tests_all_pass

# A number as models write it: a sign (only where it cannot be a minus between two
# terms: "5-7" is two numbers), thousands separators, decimals, a fraction a/b.
_NUMBER = re.compile(r"(?:(?<![\w.)\]}])[-+])?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
                     r"(?:\s*/\s*\d+(?:\.\d+)?)?")
# A number followed by words only: "12 apples", "18.90 dollars" (not "3 + 4", "2 \sqrt{3}").
_NUMBER_AND_UNIT = re.compile(rf"({_NUMBER.pattern})\s+[A-Za-z][A-Za-z\s]*")
# \frac of two numbers only: "\frac{a+b}{2}" as "a+b/2" would read as a different number.
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([-+]?[\d.,]+)\s*\}\s*\{\s*([-+]?[\d.,]+)\s*\}|\\[dt]?frac(\d)(\d)")
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_TOLERANCE = 1e-6
# Per call of math-verify's parse and verify, where its alarm-based timeout can be used.
_MATH_VERIFY_TIMEOUT_S = 5


def _detex(text: str) -> str:
    """LaTeX that hides a number, rewritten plainly: `\\frac{a}{b}` -> a/b, `\\text{x}` -> x,
    `1{,}000` and `10,\\!000` -> 1,000, `90^\\circ` -> 90, `\\$` -> $, U+2212 -> '-'."""
    text = _FRAC.sub(lambda m: f"{m.group(1) or m.group(3)}/{m.group(2) or m.group(4)}", text)
    text = _TEXT.sub(r"\1", text).replace("\u2212", "-").replace("{,}", ",").replace("\\!", "")
    text = re.sub(r"(?<=\d)\\[,;: ](?=\d)", "", text)  # a thin space between digit groups
    text = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", text)
    return re.sub(r"\\([$%])", r"\1", text)


def _value(number: str) -> float | None:
    """The value of a `_NUMBER` match (None for a zero denominator)."""
    number = re.sub(r"[\s,]", "", number)
    if "/" in number:
        num, den = (float(x) for x in number.split("/"))
        return num / den if den != 0 else None
    return float(number)


def parse_number(text: str) -> float | None:
    """The value of `text` if it is one number, allowing `$`, `%`, units ("12 apples"),
    LaTeX wrappers (`\\(12\\)`, `\\frac{1}{2}`) and a trailing period around it; else None."""
    text = re.sub(r"\\[()\[\]]|\\[,;: ]", " ", _detex(text)).replace("$", "").replace("%", "")
    text = text.strip().rstrip(".").strip()
    match = _NUMBER.fullmatch(text) or _NUMBER_AND_UNIT.fullmatch(text)
    return _value(match.group(1) if match.lastindex else match.group(0)) if match else None


def numbers_equal(a: float | None, b: float | None) -> bool:
    """Equal within the relative tolerance (absolute near 0); None equals nothing."""
    return a is not None and b is not None and math.isclose(a, b, rel_tol=_TOLERANCE, abs_tol=_TOLERANCE)


def find_numbers(text: str) -> list[str]:
    """Every number in `text`, in order, as written (after `_detex`)."""
    return [m.group(0) for m in _NUMBER.finditer(_detex(text))]


def last_number(prompt: str, response: str, answer: str) -> float:
    """1.0 when the last number in the response equals the answer. By design it is the
    LAST number: a correct answer followed by more numbers scores 0."""
    numbers = find_numbers(response)
    if not numbers:
        return 0.0
    expected = parse_number(answer)
    if expected is None:  # a non-numeric answer: compare the text
        return float(numbers[-1] == answer.strip())
    return float(numbers_equal(_value(numbers[-1]), expected))


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` with balanced braces (or the
    token after `\\boxed `, as in `\\boxed 5`); None if there is none or it is cut off."""
    match = None
    for match in re.finditer(r"\\(?:boxed|fbox)(?![A-Za-z])\s*", text):  # noqa: B007 (the last one is kept)
        pass
    if match is None:
        return None
    start = match.end()
    if not text.startswith("{", start):
        token = re.match(r"[^\s$]+", text[start:]) if match.group(0)[-1].isspace() else None
        return token.group(0) if token else None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return None  # unbalanced: the response was cut inside the box


def _normalize(text: str) -> str:
    """Formatting that does not change a LaTeX answer's meaning, removed: whitespace,
    `\\left`/`\\right`, spacing commands, `$`, `\\text{}`, `\\dfrac`, braces of `x^{2}`."""
    text = _TEXT.sub(r"\1", text)
    text = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", text)
    text = re.sub(r"\\(?:left|right|displaystyle)(?![A-Za-z])|\\[!,;: ]|\$", "", text)
    text = re.sub(r"([\^_])\{(\w)\}", r"\1\2", text)
    return re.sub(r"\s+", "", text).rstrip(".")


def _matches(found: str, answer: str) -> float:
    """By value when both are numbers, else as normalized text."""
    a, b = parse_number(found), parse_number(answer)
    if a is not None and b is not None:
        return float(numbers_equal(a, b))
    return float(_normalize(found) == _normalize(answer))


def boxed(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's last `\\boxed{}` equals the answer (or the answer's own
    boxed content, when it is a full MATH solution); no box, no reward."""
    found = last_boxed(response)
    if found is None:
        return 0.0
    expected = last_boxed(answer)
    return _matches(found, answer if expected is None else expected)


def _after_hashes(text: str) -> float | None:
    """The first number after the last `####`, None when there is no `####` or number."""
    if "####" not in text:
        return None
    numbers = find_numbers(text.rsplit("####", 1)[1])
    return _value(numbers[0]) if numbers else None


def gsm8k(prompt: str, response: str, answer: str) -> float:
    """1.0 when the number after the response's last `####` equals the answer (a bare
    number, or a GSM8K solution ending in `#### N`). Strict: no `####`, no reward."""
    expected = _after_hashes(answer) if "####" in answer else parse_number(answer)
    return float(numbers_equal(_after_hashes(response), expected))


def _math_verify_timeout() -> int | None:
    """math-verify times out with signal.alarm: that raises in any thread but the main
    one, and replaces (then cancels) a timer someone else armed (pytest-timeout's, say).
    So: its timeout on the main thread when no timer is set, else none (None disables it)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if not hasattr(signal, "setitimer") or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return None
    return _MATH_VERIFY_TIMEOUT_S


def math_verify(prompt: str, response: str, answer: str) -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the gold one."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("the math_verify reward needs the math-verify library: "
                          "pip install 'async-rl[math]'") from None
    timeout = _math_verify_timeout()
    gold_text = answer.strip()
    # math-verify reads LaTeX only between delimiters ("\frac{1}{2}" alone parses to
    # nothing), so a bare gold answer is wrapped in $...$; "\$" is a dollar sign.
    if "\\boxed" not in gold_text and not re.search(r"(?<!\\)\$", gold_text):
        gold_text = f"${gold_text}$"
    gold = parse(gold_text, parsing_timeout=timeout)
    if not gold:
        return 0.0
    pred = parse(response, parsing_timeout=timeout)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=timeout))


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "last_number": last_number,
    "boxed": boxed,
    "gsm8k": gsm8k,
    "math_verify": math_verify,
    "code_tests": code_tests,
    "code_tests_all_pass": code_tests_all_pass,
}


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve a reward spec to a callable ``f(prompt, response, answer)``: a built-in
    name (rewards.BUILTIN_REWARDS), or a user callable (`load_callable`).

    Every way this can fail raises ValueError with one line naming the spec, so a bad
    config surfaces as one readable line instead of a traceback.
    """
    if isinstance(spec, str) and spec.strip() in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec.strip()]
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"reward spec {spec!r} must be a built-in name ({', '.join(BUILTIN_REWARDS)}), "
                         f"'module:function' or 'path/to/file.py:function'")
    return load_callable(spec, "reward spec")  # type: ignore[return-value]
