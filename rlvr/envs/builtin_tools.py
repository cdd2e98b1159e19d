"""Tools that ship with the project: a calculator and a Python interpreter (`env.tools:
["rlvr.envs.builtin_tools:calculate"]`). Like every tool they run in a sandbox per call, so this
module imports the standard library only (rlvr.envs.tools)."""

from __future__ import annotations

import ast
import contextlib
import traceback
from fractions import Fraction

MAX_EXPRESSION_CHARS = 500
MAX_OUTPUT_CHARS = 4000

_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _evaluate(node: ast.AST) -> Fraction:
    """The exact value of an expression tree of integers, + - * / and unary signs."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(
        f"only integers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}"
    )


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Integers with + - * / and parentheses, for example "(12 + 7) * 31".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))


class _BoundedText:
    """A stdout that keeps the first `limit` characters written and counts the rest."""

    def __init__(self, limit: int):
        self.limit = limit
        self.parts: list[str] = []
        self.kept = 0
        self.dropped = 0

    def write(self, text: str) -> int:
        room = self.limit - self.kept
        self.parts.append(text[: max(room, 0)])
        self.kept += min(len(text), max(room, 0))
        self.dropped += max(len(text) - max(room, 0), 0)
        return len(text)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        out = "".join(self.parts)
        return out + (f"\n[... {self.dropped} more characters cut]" if self.dropped else "")


def python(code: str) -> str:
    """Run a Python snippet and return what it prints (its standard output and errors).

    Args:
        code: Python source code; use print() to see values.
    """
    out = _BoundedText(MAX_OUTPUT_CHARS)
    namespace = {"__name__": "__snippet__"}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(code, "<snippet>", "exec"), namespace)
        except BaseException as err:  # the snippet's error is its output, as in a terminal
            frames = err.__traceback__.tb_next  # from the snippet's own frame on
            out.write("".join(traceback.format_exception(type(err), err, frames)))
    return out.text()
