"""The math domain's working checked line by line, without the final answer's verdict.

Every line of the reference working (tasks/math.py) states claims that can be checked on
their own: identities (`220 * 5 = 1100`, `2*8+4=20`), a borrow (`3-1-5<0`), a column's digit
and carry, and the expression left after each step, whose value stays the answer's. An
answer's first line whose claims do not hold is where it went wrong: RL puts the blame there
(training/objectives/grpo.py `located_advantages`).
"""

import ast
import operator
import re

from tasks.base import Task

# A working line's label ("tens: ", "Left: ", "higher places copy down: ") and the clause that
# reports a column's digit and carry. What follows "Left: " or "Products first: " is the whole
# expression rewritten, so its value is the answer's.
LABEL = re.compile(r"^\s*([\w^ -]*):\s+")
REWRITTEN = ("Left", "Products first")
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
WRITE_CARRY = re.compile(r"^write (\d{1,4}) carry (\d{1,4})$")


def _integer_value(expr: str) -> int | None:
    """The value of an integer expression of +, -, * and parentheses; None for anything else
    (words, a division, a number too long to be working)."""
    if len(expr) > 200:
        return None
    try:
        node = ast.parse(expr.strip(), mode="eval").body
    except (SyntaxError, ValueError):  # a null byte is a ValueError
        return None

    def value(n: ast.expr) -> int | None:
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return n.value
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            v = value(n.operand)
            return None if v is None else -v
        if isinstance(n, ast.BinOp) and type(n.op) in OPERATORS:
            a, b = value(n.left), value(n.right)
            return None if a is None or b is None else OPERATORS[type(n.op)](a, b)
        return None

    return value(node)


def line_holds(line: str, answer: int) -> bool:
    """Whether every claim the line makes holds: each `a = b = c` an identity (both sides
    integer expressions), a borrow's `x-1-y<0` below zero, a column's `write d carry c` the
    digit and carry of the value before it, the expression left after a step worth `answer`.
    A line with no such claim holds."""
    label = LABEL.match(line)
    body = line[label.end() :] if label else line
    if label and label[1] in REWRITTEN:
        value = _integer_value(body)
        return value is None or value == answer
    clauses = body.strip().removeprefix("So ").rstrip(".:").split(", ")
    last = None
    for clause in clauses:
        if carry := WRITE_CARRY.match(clause):
            if last is not None and (int(carry[1]), int(carry[2])) != (last % 10, last // 10):
                return False
        elif clause.endswith("<0"):
            v = _integer_value(clause[:-2])
            if v is not None and v >= 0:
                return False
        elif "=" in clause:
            values = [_integer_value(side) for side in clause.split("=")]
            if None not in values and len(set(values)) > 1:
                return False
            last = values[-1]
    return True


def first_false_line(task: Task, completion: str) -> tuple[int, int] | None:
    """The character span of the completion's first line that does not hold (`line_holds`),
    newline included; None when every line holds. A wrong step no line shows on its own (a
    digit copied wrong from the line above) is left to the final answer's check."""
    start = 0
    for line in completion.splitlines(keepends=True):
        if not line_holds(line, task.data["answer"]):
            return start, start + len(line)
        start += len(line)
    return None
