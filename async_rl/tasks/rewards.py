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
  `async-rl[math]`), for answers like `\\frac{\\sqrt{2}}{2}` vs `\\sqrt{2}/2`.

Numbers compare by value: "1,234" = "1234", "3.50" = "3.5", "3/4" = "0.75",
"\\frac{1}{2}" = "0.5", with a relative tolerance of 1e-6.
"""
from __future__ import annotations

import math
import re
import threading

from async_rl.tasks.arithmetic import exact_match

# A number as models write it: sign, thousands separators, decimals, a fraction a/b.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|[-+]?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}|\\[dt]?frac(\d)(\d)")
_TOLERANCE = 1e-6


def parse_number(text: str) -> float | None:
    """The value of `text` if it is one number (units, `$`, `%`, LaTeX wrappers and a
    trailing period allowed around it), else None."""
    text = _unfrac(text.strip())
    text = re.sub(r"\\[()\[\]]|\\!|\\,|\$|%|\\%", "", text).strip().rstrip(".").strip()
    match = _NUMBER.fullmatch(text) or _NUMBER.fullmatch(text.split(" ")[0])
    return _value(match.group(0)) if match else None


def _unfrac(text: str) -> str:
    """`\\frac{a}{b}`, `\\dfrac{a}{b}` and `\\frac12` as `a/b`."""
    return _FRAC.sub(lambda m: f"{m.group(1) or m.group(3)}/{m.group(2) or m.group(4)}", text)


def _value(number: str) -> float | None:
    number = number.replace(",", "").replace(" ", "")
    if "/" in number:
        num, den = number.split("/")
        return float(num) / float(den) if float(den) != 0 else None
    return float(number)


def numbers_equal(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=_TOLERANCE, abs_tol=_TOLERANCE)


def _matches(found: str, answer: str) -> float:
    """1.0 when the extracted text equals the answer: by value when both are numbers,
    else as normalized text."""
    a, b = parse_number(found), parse_number(answer)
    if a is not None and b is not None:
        return float(numbers_equal(a, b))
    return float(_normalize(found) == _normalize(answer))


def _normalize(text: str) -> str:
    text = re.sub(r"\\left|\\right|\\!|\\,|\\ |\$", "", text)
    return re.sub(r"\s+", "", text).rstrip(".")


def last_number(prompt: str, response: str, answer: str) -> float:
    """1.0 when the last number in the response equals the answer."""
    numbers = _NUMBER.findall(_unfrac(response))
    if not numbers:
        return 0.0
    found = numbers[-1].strip()
    expected = parse_number(answer)
    if expected is None:  # a non-numeric answer: compare the text
        return float(found == answer.strip())
    return float(numbers_equal(_value(found), expected))


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}`, braces balanced; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1:i]
    return None  # unbalanced: the response was cut inside the box


def boxed(prompt: str, response: str, answer: str) -> float:
    """1.0 when the last `\\boxed{}` of the response equals the answer (or its boxed content)."""
    found = last_boxed(response)
    if found is None:
        return 0.0
    expected = last_boxed(answer)
    return _matches(found, answer if expected is None else expected)


def _after_hashes(text: str) -> str | None:
    return text.rsplit("####", 1)[1].strip() if "####" in text else None


def gsm8k(prompt: str, response: str, answer: str) -> float:
    """1.0 when the number after the response's last `####` equals the answer's final
    number (a bare number, or a GSM8K solution ending in `#### N`)."""
    found = _after_hashes(response)
    if found is None:
        return 0.0
    numbers = _NUMBER.findall(found)
    expected = _after_hashes(answer)
    return float(bool(numbers) and numbers_equal(_value(numbers[0]), parse_number(
        answer if expected is None else expected)))


def math_verify(prompt: str, response: str, answer: str) -> float:
    """1.0 when math-verify finds the response's answer equivalent to the gold one."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("the math_verify reward needs the math-verify library: pip install 'async-rl[math]'") from None
    # math-verify's timeouts use signal.alarm, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    gold = parse(gold_text, parsing_timeout=timeout)
    pred = parse(response, parsing_timeout=timeout)
    return float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout))


BUILTIN_REWARDS = {"exact_match": exact_match, "last_number": last_number, "boxed": boxed, "gsm8k": gsm8k,
                   "math_verify": math_verify}
