"""Built-in coding task (`task.name: coding`): write a short Python function, scored by
running it against unit tests in the sandbox (the `code_tests` reward).

    Write a Python function `sum_even(nums)` that returns the sum of the even numbers
    in the list of integers `nums` (0 when there are none).
    Example: `sum_even([14, 1, -12, -6])` returns `-4`.
    Reply with the function in a ```python code block.

    tests: ["assert sum_even([0, -9]) == 0", "assert sum_even([8, 15, -15, 18, -2, 28]) == 52", ...]

Each prompt comes from a family (sum of the multiples of k, count a letter, reverse the
words, a Fibonacci-like sequence, max minus min, palindrome, clamp, ...) drawn with a
function name, an argument name and constants, so prompts are many and distinct. Its
`fields["tests"]` are five assert lines (at least three where a family has few inputs),
their expected values computed here by running the reference solution on seeded
inputs; the example in the prompt uses yet another input. `answer` is the reference
solution as a ```python block, so the answer itself scores 1.0; the model never sees it.

Held out: four whole families (count vowels, length of the longest or shortest word,
is the list sorted, product of the odd or even numbers) are never drawn for training,
so evaluation measures writing functions not trained on. The held-out set is a fixed
sample chosen by `eval_seed` (the same for every run seed); training prompts are a pure
function of (seed, index). Plain text (one user turn), so it suits base models too.
Made by our own code: nothing downloaded.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from async_rl.tasks.base import EVAL_ID_OFFSET, Prompt
from async_rl.tasks.code_rewards import code_tests

INSTRUCTION = "Reply with the function in a ```python code block."
TESTS_PER_PROMPT, MIN_TESTS = 5, 3
WORDS = ("a", "ox", "sky", "cat", "moon", "tree", "idea", "noon", "apple", "river", "level", "radar", "stone",
         "green", "orange", "garden", "yellow", "window", "banana", "kitchen", "elephant", "umbrella")
LIST_ARGS = ("numbers", "nums", "values", "items", "data")
TEXT_ARGS = ("text", "s", "sentence", "phrase")
LETTERS = "aeilnorst"


@dataclass(frozen=True)
class Problem:
    """One function to write: `name(params)` that does what `says` ("returns ..."),
    a reference `solution`, and how to draw arguments for a call."""

    name: str
    params: tuple[str, ...]
    says: str
    solution: str
    arguments: Callable[[np.random.Generator], tuple]


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def _ints(rng: np.random.Generator, low: int, high: int, min_len: int, max_len: int) -> list[int]:
    return [int(x) for x in rng.integers(low, high + 1, size=int(rng.integers(min_len, max_len + 1)))]


def _text(rng: np.random.Generator, min_words: int, max_words: int) -> str:
    return " ".join(_pick(rng, WORDS) for _ in range(int(rng.integers(min_words, max_words + 1))))


def _text_with(rng: np.random.Generator, letter: str, min_words: int, max_words: int) -> str:
    """Words that mostly hold `letter`: a test where it is absent tells little."""
    text = _text(rng, min_words, max_words)
    if letter not in text and rng.random() < 0.8:
        text = f"{text} {_pick(rng, [w for w in WORDS if letter in w])}"
    return text


def _around(rng: np.random.Generator, low: int, high: int) -> int:
    """Below `low`, within [low, high] or above `high`, a third of the time each."""
    side = int(rng.integers(3))
    return int(rng.integers(low - 10, low)) if side == 0 else \
        int(rng.integers(low, high + 1)) if side == 1 else int(rng.integers(high + 1, high + 11))


def _function(name: str, params: tuple[str, ...], body: str) -> str:
    return f"def {name}({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in body.splitlines())


# ---------------------------------------------------------------- training families


def _sum_multiples(rng):
    k, arg = int(rng.integers(2, 6)), _pick(rng, LIST_ARGS)
    if k == 2:
        name, what = _pick(rng, ("sum_even", "even_total", "sum_of_evens")), "even numbers"
    else:
        name, what = _pick(rng, (f"sum_multiples_of_{k}", f"sum_divisible_by_{k}")), f"numbers divisible by {k}"
    return Problem(name, (arg,), f"returns the sum of the {what} in the list of integers `{arg}` (0 when there "
                   "are none)", _function(name, (arg,), f"return sum(x for x in {arg} if x % {k} == 0)"),
                   lambda r: (_ints(r, -20, 30, 0, 7),))


def _count_letter(rng):
    c, arg = _pick(rng, LETTERS), _pick(rng, TEXT_ARGS)
    name = _pick(rng, (f"count_{c}", f"{c}_count", f"letter_{c}_count"))
    return Problem(name, (arg,), f"returns how many times the letter '{c}' occurs in the string `{arg}`",
                   _function(name, (arg,), f"return {arg}.count({c!r})"), lambda r: (_text_with(r, c, 1, 3),))


def _reverse_words(rng):
    name, arg = _pick(rng, ("reverse_words", "words_reversed", "flip_words")), _pick(rng, TEXT_ARGS)
    return Problem(name, (arg,), f"returns the words of the string `{arg}` in reverse order, joined by single "
                   "spaces", _function(name, (arg,), f'return " ".join({arg}.split()[::-1])'),
                   lambda r: (_text(r, 1, 5),))


def _fibonacci(rng):
    first, second = int(rng.integers(0, 3)), int(rng.integers(1, 4))
    name, n = _pick(rng, ("fib", "fibonacci", "nth_term", "sequence_term")), _pick(rng, ("n", "k", "index"))
    if (first, second) == (0, 1):
        says = f"returns the `{n}`-th Fibonacci number, where {name}(0) == 0 and {name}(1) == 1"
    else:
        says = (f"returns term `{n}` of the sequence {first}, {second}, {first + second}, ... in which each term "
                f"after the first two is the sum of the two before it ({name}(0) == {first})")
    body = f"a, b = {first}, {second}\nfor _ in range({n}):\n    a, b = b, a + b\nreturn a"
    return Problem(name, (n,), says, _function(name, (n,), body), lambda r: (int(r.integers(0, 16)),))


def _spread(rng):
    name, arg = _pick(rng, ("spread", "max_minus_min", "value_range")), _pick(rng, LIST_ARGS)
    return Problem(name, (arg,), f"returns the largest number in the non-empty list of integers `{arg}` minus "
                   "the smallest", _function(name, (arg,), f"return max({arg}) - min({arg})"),
                   lambda r: (_ints(r, -50, 50, 1, 7),))


def _palindrome_argument(rng, mixed_case: bool) -> tuple:
    word = _pick(rng, WORDS)
    if rng.random() < 0.5:
        word = word + word[::-1][int(rng.integers(0, 2)):]
    if mixed_case:
        word = "".join(ch.upper() if rng.random() < 0.3 else ch for ch in word)
    return (word,)


def _palindrome(rng):
    name, arg, ignore_case = (_pick(rng, ("is_palindrome", "reads_same_backwards", "palindrome")),
                              _pick(rng, TEXT_ARGS), bool(rng.random() < 0.5))
    how = ", ignoring upper and lower case" if ignore_case else " (upper and lower case differ)"
    body = f"t = {arg}.lower()\nreturn t == t[::-1]" if ignore_case else f"return {arg} == {arg}[::-1]"
    return Problem(name, (arg,), f"returns True when the string `{arg}` reads the same forwards and "
                   f"backwards{how}, else False", _function(name, (arg,), body),
                   lambda r: _palindrome_argument(r, ignore_case))


def _clamp_arguments(rng) -> tuple:
    low = int(rng.integers(-20, 10))
    high = low + int(rng.integers(0, 20))
    return _around(rng, low, high), low, high


def _clamp(rng):
    name, x = _pick(rng, ("clamp", "limit", "bound")), _pick(rng, ("x", "value", "n"))
    if rng.random() < 0.5:
        params = (x, "lo", "hi")
        return Problem(name, params, f"returns `{x}` limited to the range from `lo` to `hi` (lo <= hi): `lo` when "
                       f"`{x}` is smaller, `hi` when it is larger, else `{x}` itself",
                       _function(name, params, f"return max(lo, min(hi, {x}))"), _clamp_arguments)
    low = int(rng.integers(-10, 1))
    high = low + int(rng.integers(1, 21))
    return Problem(name, (x,), f"returns `{x}` limited to the range from {low} to {high}: {low} when `{x}` is "
                   f"smaller, {high} when it is larger, else `{x}` itself",
                   _function(name, (x,), f"return max({low}, min({high}, {x}))"),
                   lambda r: (_around(r, low, high),))


def _count_above(rng):
    t, arg = int(rng.integers(-5, 21)), _pick(rng, LIST_ARGS)
    name = _pick(rng, ("count_above", "count_greater", "how_many_above"))
    return Problem(name, (arg,), f"returns how many numbers in the list of integers `{arg}` are greater than {t}",
                   _function(name, (arg,), f"return sum(1 for x in {arg} if x > {t})"),
                   lambda r: (_ints(r, t - 15, t + 15, 0, 7),))


def _scale_shift(rng):
    k, c, arg = int(rng.integers(2, 6)), int(rng.integers(0, 10)), _pick(rng, LIST_ARGS)
    name = _pick(rng, ("scale", "transform", "scaled"))
    then = f" and then increased by {c}" if c else ""
    return Problem(name, (arg,), f"returns a new list holding each number of the list `{arg}` multiplied by {k}"
                   f"{then}, in the same order", _function(name, (arg,), f"return [x * {k} + {c} for x in {arg}]"),
                   lambda r: (_ints(r, -10, 10, 0, 6),))


def _digit_sum(rng):
    name, arg = _pick(rng, ("digit_sum", "sum_of_digits", "add_digits")), _pick(rng, ("n", "number", "value"))
    return Problem(name, (arg,), f"returns the sum of the decimal digits of the non-negative integer `{arg}`",
                   _function(name, (arg,), f"return sum(int(d) for d in str({arg}))"),
                   lambda r: (int(r.integers(0, 10 ** int(r.integers(1, 6)))),))


def _power_sum(rng):
    p, n = int(rng.integers(1, 4)), _pick(rng, ("n", "limit", "k"))
    name, what = {1: (_pick(rng, ("sum_up_to", "triangle")), "the whole numbers"),
                  2: (_pick(rng, ("sum_of_squares", "square_sum")), "the squares of the whole numbers"),
                  3: (_pick(rng, ("sum_of_cubes", "cube_sum")), "the cubes of the whole numbers")}[p]
    return Problem(name, (n,), f"returns the sum of {what} from 1 to `{n}` (0 when `{n}` is 0)",
                   _function(name, (n,), f"return sum(i ** {p} for i in range(1, {n} + 1))"),
                   lambda r: (int(r.integers(0, 21)),))


def _remove_letter(rng):
    c, arg = _pick(rng, LETTERS), _pick(rng, TEXT_ARGS)
    name = _pick(rng, (f"remove_{c}", f"without_{c}", f"drop_{c}"))
    return Problem(name, (arg,), f"returns the string `{arg}` with every letter '{c}' removed",
                   _function(name, (arg,), f"return {arg}.replace({c!r}, '')"), lambda r: (_text_with(r, c, 1, 2),))


def _capitalize_words(rng):
    name, arg = _pick(rng, ("capitalize_words", "title_words", "upper_initials")), _pick(rng, TEXT_ARGS)
    return Problem(name, (arg,), f"returns the lowercase string `{arg}` with the first letter of each word made "
                   "upper case, words joined by single spaces",
                   _function(name, (arg,), f'return " ".join(w[0].upper() + w[1:] for w in {arg}.split())'),
                   lambda r: (_text(r, 1, 4),))


# ---------------------------------------------------------------- held-out families


def _count_vowels(rng):
    vowels = _pick(rng, ("aeiou", "aeiouy"))
    name, arg = _pick(rng, ("count_vowels", "vowel_count", "number_of_vowels")), _pick(rng, TEXT_ARGS)
    listed = "a, e, i, o, u" + (" and y" if vowels.endswith("y") else "")
    return Problem(name, (arg,), f"returns how many vowels ({listed}) the lowercase string `{arg}` contains",
                   _function(name, (arg,), f"return sum(1 for ch in {arg} if ch in {vowels!r})"),
                   lambda r: (_text(r, 0, 4),))


def _word_length(rng):
    longest, arg = bool(rng.random() < 0.5), _pick(rng, TEXT_ARGS)
    name = _pick(rng, ("longest_word_length", "max_word_length") if longest else
                 ("shortest_word_length", "min_word_length"))
    which = "max" if longest else "min"
    return Problem(name, (arg,), f"returns the length of the {'longest' if longest else 'shortest'} word in the "
                   f"string `{arg}`, whose words are separated by spaces (0 when it has no words)",
                   _function(name, (arg,), f"return {which}((len(w) for w in {arg}.split()), default=0)"),
                   lambda r: (_text(r, 0, 5),))


def _sorted_argument(rng, descending: bool) -> tuple:
    values = _ints(rng, 0, 9, 2, 6) if rng.random() < 0.9 else _ints(rng, 0, 9, 0, 1)
    if rng.random() < 0.5:
        values.sort(reverse=descending)
    return (values,)


def _is_sorted(rng):
    descending, strict, arg = bool(rng.random() < 0.5), bool(rng.random() < 0.5), _pick(rng, LIST_ARGS)
    name = _pick(rng, ("is_descending", "goes_down") if descending else ("is_sorted", "is_ascending"))
    relation = ("smaller than" if strict else "smaller than or equal to") if descending else \
        ("greater than" if strict else "greater than or equal to")
    op = {(False, False): "<=", (False, True): "<", (True, False): ">=", (True, True): ">"}[(descending, strict)]
    return Problem(name, (arg,), f"returns True when each number in the list `{arg}` is {relation} the one "
                   f"before it, else False (True for a list of fewer than two numbers)",
                   _function(name, (arg,), f"return all(a {op} b for a, b in zip({arg}, {arg}[1:]))"),
                   lambda r: _sorted_argument(r, descending))


def _parity_product(rng):
    odd, arg = bool(rng.random() < 0.5), _pick(rng, LIST_ARGS)
    name = _pick(rng, ("product_of_odds", "odd_product") if odd else ("product_of_evens", "even_product"))
    body = f"result = 1\nfor x in {arg}:\n    if x % 2 == {int(odd)}:\n        result *= x\nreturn result"
    return Problem(name, (arg,), f"returns the product of the {'odd' if odd else 'even'} numbers in the list of "
                   f"integers `{arg}` (1 when there are none)", _function(name, (arg,), body),
                   lambda r: (_ints(r, -9, 9, 0, 6),))


TRAIN_FAMILIES = (_sum_multiples, _count_letter, _reverse_words, _fibonacci, _spread, _palindrome, _clamp,
                  _count_above, _scale_shift, _digit_sum, _power_sum, _remove_letter, _capitalize_words)
HELD_OUT_FAMILIES = (_count_vowels, _word_length, _is_sorted, _parity_product)


def _call(name: str, arguments: tuple) -> str:
    return f"{name}({', '.join(repr(a) for a in arguments)})"


def pose(problem: Problem, rng: np.random.Generator) -> tuple[str, str, list[str]]:
    """(question, answer, tests) of `problem`: the expected values are the reference
    solution's, run here on our own seeded inputs."""
    scope: dict[str, Any] = {}
    exec(problem.solution, scope)  # noqa: S102 - our own reference solution, never model output
    reference = scope[problem.name]
    example = problem.arguments(rng)
    calls: dict[str, tuple] = {}
    for _ in range(8 * TESTS_PER_PROMPT):  # families with few distinct inputs stop short of TESTS_PER_PROMPT
        arguments = problem.arguments(rng)
        call = _call(problem.name, arguments)
        if call != _call(problem.name, example):
            calls.setdefault(call, arguments)
        if len(calls) == TESTS_PER_PROMPT:
            break
    if len(calls) < MIN_TESTS:
        raise RuntimeError(f"coding: {problem.name} drew fewer than {MIN_TESTS} distinct test inputs")
    tests = [f"assert {call} == {reference(*arguments)!r}" for call, arguments in calls.items()]
    question = (f"Write a Python function `{problem.name}({', '.join(problem.params)})` that {problem.says}.\n"
                f"Example: `{_call(problem.name, example)}` returns `{reference(*example)!r}`.\n{INSTRUCTION}")
    return question, f"```python\n{problem.solution}```", tests


class CodingTask:
    """Training prompts from TRAIN_FAMILIES, held-out ones from HELD_OUT_FAMILIES."""

    NAME, EVAL_SALT = "coding", 0xC0DE

    def __init__(self, *, seed: int, eval_size: int = 256, eval_seed: int = 0,
                 eval_families: str = "held_out") -> None:
        """`eval_families`: "held_out" (HELD_OUT_FAMILIES), or "trained": new prompts of
        TRAIN_FAMILIES from the evaluation's own random stream (how well a run learned what
        it trained on, rather than how far that carries)."""
        if not 1 <= eval_size <= 5000:
            raise ValueError(f"{self.NAME}: eval_size must be in 1..5000, got {eval_size}")
        if eval_families not in ("held_out", "trained"):
            raise ValueError(f"{self.NAME}: eval_families must be 'held_out' or 'trained', got {eval_families!r}")
        families = HELD_OUT_FAMILIES if eval_families == "held_out" else TRAIN_FAMILIES
        self.seed, self.eval_size = int(seed), eval_size
        self._eval: list[tuple[str, str, list[str]]] = []
        seen: set[str] = set()
        rng = np.random.default_rng([eval_seed, self.EVAL_SALT])
        for _ in range(10 * eval_size):  # the example's input makes repeats rare
            question, answer, tests = pose(_pick(rng, families)(rng), rng)
            if question not in seen:
                seen.add(question)
                self._eval.append((question, answer, tests))
            if len(self._eval) == eval_size:
                break
        else:
            raise ValueError(f"{self.NAME}: cannot draw {eval_size} distinct held-out prompts")

    def train_prompt(self, index: int) -> Prompt:
        if index < 0:
            raise IndexError(f"prompt index must be >= 0, got {index}")
        rng = np.random.default_rng([self.seed, index])
        return self._prompt(index, *pose(_pick(rng, TRAIN_FAMILIES)(rng), rng))

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(EVAL_ID_OFFSET + k, *posed) for k, posed in enumerate(self._eval)]

    def _prompt(self, prompt_id: int, question: str, answer: str, tests: list[str]) -> Prompt:
        return Prompt(id=prompt_id, text=question, answer=answer, fields={"tests": list(tests)})

    def reward(self, prompt: str, response: str, answer: str, tests: Any = None, **fields: Any) -> float:
        return code_tests(prompt, response, answer, tests, **fields)
