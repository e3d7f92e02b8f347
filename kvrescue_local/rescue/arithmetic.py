"""The arithmetic a step states, checked: "expression = number" equalities whose expression is plain numbers and
operators, evaluated and compared with the number written.

A 0.5B helper and an evicted base both write equalities like "15 × 0.08 = 12" or "$68 + $330 = $408". A step that
states a false one carries a wrong number into every later step. Only closed arithmetic is checked: an equality with
a variable in it ("x + 5 + 3 = 10"), a time ("2:15 + 15 = 2:30"), a unit inside it ("111 feet - 120 inches = 101
feet"), a fraction or an expression on the right is skipped, and a number is taken as right when it is the value
rounded or cut at the precision it is written with ("2/3 = 0.67", "7 / 2 = 3"): what the check calls false is
arithmetic as written, and what it cannot read it leaves alone.
"""

from __future__ import annotations

import ast
import re

MAX_EXPONENT = 64  # larger powers are not word-problem arithmetic, and would be slow to evaluate

_LATEX = ((r"\times", "*"), (r"\cdot", "*"), ("×", "*"), ("·", "*"), ("÷", "/"), (r"\div", "/"), ("−", "-"),
          (r"\left", ""), (r"\right", ""), (r"\$", ""), ("$", ""), (r"\(", " "), (r"\)", " "), (r"\[", " "),
          (r"\]", " "))
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{[^{}]*\}")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# an arithmetic expression (it starts with a number or a parenthesis and holds nothing but numbers, operators and
# parentheses), "=", a number that ends there (no unit glued to it, no operator after it)
_EQUALITY = re.compile(r"(?P<lhs>(?:\(\s*)*-?\d[\d.()\s+\-*/^]*?)=\s*(?P<rhs>-?\d+(?:\.\d+)?)"
                       r"(?![\d.:/\w(\\{]|\s*\(|\s*[-+*/^]\s*[\d(])")
_OPERATOR = re.compile(r"[\d)]\s*[-+*/^]\s*[-\d(]")
_GLUED = re.compile(r"[\w.:{}\\^%]$")  # a character glued to the expression's start makes it part of something longer
_OPERAND = re.compile(r"[-+*/^]\s*$")  # an operator before it: the expression is a part of one with more in it


def plain(text: str) -> str:
    """The text with LaTeX's arithmetic written as Python's and thousands separators dropped; a text macro becomes a
    word, so that no expression reaches across a unit ("111 \\text{ feet} - 120 \\text{ inches}")."""
    for latex, python in _LATEX:
        text = text.replace(latex, python)
    previous = None
    while previous != text:  # nested fractions, innermost first
        previous, text = text, _FRAC.sub(r"((\1)/(\2))", text)
    return _THOUSANDS.sub("", _TEXT.sub(" unit ", text))


def evaluate(expression: str) -> float | None:
    """The value of an expression of numbers, + - * / ^ and parentheses; None for anything else."""
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except (SyntaxError, ValueError):
        return None

    def value(node) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if isinstance(node.op, ast.Div):
                return left / right
            if isinstance(node.op, ast.Pow) and abs(right) <= MAX_EXPONENT and abs(left) <= 1e6:
                return left ** right
        raise ValueError("not plain arithmetic")

    try:
        result = value(tree.body)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError):
        return None
    return result if isinstance(result, float) else None


def agrees(value: float, written: str) -> bool:
    """Whether `written` is `value` rounded or cut at the precision it is written with."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    return abs(value - float(written)) < 10.0 ** -decimals * (1 - 1e-9)  # less than one unit of its last digit


def false_equalities(text: str) -> list[str]:
    """The equalities of closed arithmetic that `text` states and that are false, as written after `plain`."""
    out = []
    for line in plain(text).splitlines():
        for match in _EQUALITY.finditer(line):
            lhs = match.group("lhs").strip()
            before = line[:match.start()]
            if _GLUED.search(before) or _OPERAND.search(before) or not _OPERATOR.search(lhs):
                continue
            value = evaluate(lhs)
            if value is not None and not agrees(value, match.group("rhs")):
                out.append(f"{lhs} = {match.group('rhs')}")
    return out
