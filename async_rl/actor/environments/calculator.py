"""The built-in tool environment (`env.name: calculator`): arithmetic the policy asks
for in its turn, answered in the next; a turn without a call is the final answer.

    policy:       Let me compute. <calc>37 * 24</calc>
    environment:  <result>888</result>                      (a user turn)
    policy:       The answer is 888.                        -> the task's reward, done

The policy calls the tool by writing `<calc>EXPRESSION</calc>` (set `actors.stop:
["</calc>"]` so the turn ends at the call); the first call of a turn is evaluated. The
expression is arithmetic only: numbers, + - * / // % **, unary signs and parentheses,
parsed with `ast` and evaluated node by node, never `eval`: no names, calls or
attributes, so no file, network or other effect is reachable. Size limits keep every
call cheap: the expression's length, exponents, and the magnitude of every
intermediate result. A refused or failing expression is answered `<error>...</error>`:
the policy's mistake, not the environment's.
"""
from __future__ import annotations

import ast
import math
import operator

from async_rl.actor.environments.tagged_tool import TaggedTool, first_tagged_call

OPEN, CLOSE = "<calc>", "</calc>"
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e18
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    pass


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError names what is refused."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise CalculatorError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent beyond {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except (OverflowError, TypeError):  # TypeError: a complex power (negative base, fractional exponent)
            raise CalculatorError("result out of range") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed: numbers and + - * / // % ** only")


def _bounded(x: int | float) -> int | float:
    if isinstance(x, complex) or not math.isfinite(x) or abs(x) > MAX_MAGNITUDE:
        raise CalculatorError("result out of range")
    return x


def format_value(x: int | float) -> str:
    """Integers exactly; other floats to 12 significant digits, so that 0.1 + 0.2 reads
    0.3 and 2**-64 keeps its value."""
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return f"{x:.12g}" if isinstance(x, float) else str(x)


def first_call(action: str) -> str | None:
    """The expression of the turn's first complete `<calc>...</calc>`, in linear time."""
    return first_tagged_call(action, OPEN, CLOSE)


class Calculator(TaggedTool):
    """One episode: answers `<calc>` calls; scores the final answer with `score(prompt,
    response, answer)` (the task's reward)."""

    open_tag, close_tag = OPEN, CLOSE

    def answer(self, expression: str) -> str:
        try:
            return f"<result>{format_value(evaluate(expression))}</result>"
        except CalculatorError as err:
            return f"<error>{err}</error>"
