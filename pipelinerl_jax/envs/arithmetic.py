"""Evaluates an arithmetic expression safely: numbers, + - * / // % **, parentheses, unary
signs. Parsed with `ast` and walked by hand: no `eval`, no names, no calls, no attributes,
and bounds on the sizes a power or a product can reach, so a model cannot make the
environment hang or run out of memory.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

MAX_CHARS = 200
MAX_ABS = 10**12  # results and intermediate values beyond this are refused
MAX_EXPONENT = 64

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ExpressionError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def _check(value: Fraction) -> Fraction:
    if abs(value) > MAX_ABS:
        raise ExpressionError(f"a value beyond {MAX_ABS:.0e}")
    return value


def _walk(node) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ExpressionError("a non-finite number")
        return _check(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ExpressionError("division by zero")
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ExpressionError(f"powers take whole exponents up to {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ExpressionError("division by zero")
        return _check(Fraction(_BINARY[type(node.op)](left, right)))
    raise ExpressionError(f"{type(node).__name__} is not arithmetic")


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression`; ExpressionError naming what is wrong otherwise."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    text = text.replace(",", "")  # thousands separators: "1,200" is 1200
    if not text:
        raise ExpressionError("an empty expression")
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ExpressionError("not an expression") from None
    return _walk(tree)


def show(value: Fraction) -> str:
    """An integer as is, else a decimal rounded to 6 places (trailing zeros dropped)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")
