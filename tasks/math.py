"""Integer arithmetic: expressions with +, -, * and parentheses, checked by their value.

The reference trace is written for a small model to imitate: it evaluates the expression
innermost first, one operation per line, and spells long operations out digit by digit
(column addition with carries, column subtraction with borrows, multiplication as partial
products by the digits of the shorter operand), so no line asks for more than one-digit
arithmetic or adding a few round numbers. Every `a = b = c` on a line is an exact identity,
which the tests check with `eval`.

Difficulty (operations per expression, digits per operand, digits of the small factor that
every multiplication has on one side, which keeps products and their traces bounded):

    1: 1-2 operations, operands of 1-2 digits, factor of 1 digit
    2: 2-3 operations, operands of 1-4 digits, factor of up to 2 digits
    3: 3-4 operations, operands of 1-4 digits, factor of up to 2 digits

An expression whose working takes more than `TRACE_LINES` lines is drawn again: at about 16
tokens a line, the reference then fits the eval's 512-token answer budget (all of difficulty 1;
of 400 drawn, 399 of difficulty 2 and 387 of difficulty 3).
"""

import random
from typing import Any

from tasks.answers import final_integer, reasoning_block, split_reasoning
from tasks.base import (
    MAX_DIFFICULTY,
    MIN_DIFFICULTY,
    Domain,
    Episode,
    SingleAnswerEpisode,
    Style,
    Task,
    Verdict,
)
from tasks.math_working import first_false_line

# difficulty -> (min operations, max operations, max operand digits, max factor digits)
LEVELS = {1: (1, 2, 2, 1), 2: (2, 3, 4, 2), 3: (3, 4, 4, 2)}
TRACE_LINES = 28
PROMPTS = (
    "Compute {expr}. Answer with the integer only.",
    "What is {expr}? Reply with just the integer.",
    "Evaluate {expr} and give the result as a single integer.",
    "Calculate {expr}. Give only the final integer.",
)
PLACES = ("ones", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands")
PLACES += ("millions", "ten-millions", "hundred-millions", "billions", "ten-billions")
PRECEDENCE = {"+": 1, "-": 1, "*": 2}
# An integer, optionally with thousands separators ("1,234,567" or "1 234 567"); a minus
# counts only when it does not follow a digit ("12-3" holds 12 and 3).


# An expression tree as JSON-friendly data: an int, or [op, left, right].
Tree = int | list[Any]


def evaluate(tree: Tree) -> int:
    if isinstance(tree, int):
        return tree
    op, a, b = tree[0], evaluate(tree[1]), evaluate(tree[2])
    return a + b if op == "+" else a - b if op == "-" else a * b


def render(tree: Tree, grouped: bool = False) -> str:
    """Infix text with only the parentheses needed to read back the same tree: operators are
    left-associative, so a right operand of equal precedence keeps its parentheses.
    `grouped` also brackets every product inside a sum, so that "brackets first, then left
    to right" is the whole rule for what comes next: no precedence to work out."""
    if isinstance(tree, int):
        return _show(tree)
    op, left, right = tree
    a, b = render(left, grouped), render(right, grouped)
    if isinstance(left, list) and _bracketed(left[0], op, grouped):
        a = f"({a})"
    if isinstance(right, list) and (
        PRECEDENCE[right[0]] == PRECEDENCE[op] or _bracketed(right[0], op, grouped)
    ):
        b = f"({b})"
    return f"{a} {op} {b}"


def _bracketed(inner: str, outer: str, grouped: bool) -> bool:
    return PRECEDENCE[inner] < PRECEDENCE[outer] or (
        grouped and PRECEDENCE[inner] > PRECEDENCE[outer]
    )


def operands(tree: Tree) -> list[int]:
    return [tree] if isinstance(tree, int) else operands(tree[1]) + operands(tree[2])


def count_ops(tree: Tree) -> int:
    return 0 if isinstance(tree, int) else 1 + count_ops(tree[1]) + count_ops(tree[2])


def _number(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    return rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _build(rng: random.Random, n_ops: int, max_digits: int, factor_digits: int) -> Tree:
    """A random tree with `n_ops` operations; a product always has a leaf factor of at most
    `factor_digits` digits on one side."""
    if n_ops == 0:
        return _number(rng, max_digits)
    op = rng.choice("+-*")
    if op == "*":
        big = _build(rng, n_ops - 1, max_digits, factor_digits)
        small = _number(rng, factor_digits)
        return [op, big, small] if rng.random() < 0.5 else [op, small, big]
    n_left = rng.randint(0, n_ops - 1)
    left = _build(rng, n_left, max_digits, factor_digits)
    return [op, left, _build(rng, n_ops - 1 - n_left, max_digits, factor_digits)]


def _place(i: int) -> str:
    return PLACES[i] if i < len(PLACES) else f"10^{i}"


def _column_add(a: int, b: int) -> list[str]:
    """Column addition of two non-negative numbers, lowest place first; once one operand
    has no digits left and nothing is carried, the other's higher places copy down."""
    lines, carry, i = [], 0, 0
    while a or b or carry:
        if i and not carry and not (a and b):
            lines.append(f"  higher places copy down: {a or b}")
            break
        x, y = a % 10, b % 10
        total = x + y + carry
        terms = f"{x}+{y}" + ("+1" if carry else "")
        note = f", write {total % 10} carry 1" if total >= 10 else ""
        lines.append(f"  {_place(i)}: {terms}={total}{note}")
        a, b, carry, i = a // 10, b // 10, total // 10, i + 1
    return lines


def _column_sub(a: int, b: int) -> list[str]:
    """Column subtraction a - b for a >= b >= 0, lowest place first; once b has no digits
    left and nothing is borrowed, a's higher places copy down. A column that borrows says so
    after its digits ("3-1-5<0"), not before them: the decision is read off the line."""
    lines, borrow, i = [], 0, 0
    while a:
        if i and not borrow and not b:
            lines.append(f"  higher places copy down: {a}")
            break
        x, y = a % 10, b % 10
        terms = f"{x}" + ("-1" if borrow else "") + f"-{y}"
        diff = x - borrow - y
        borrow = int(diff < 0)
        if borrow:  # the digits first, then whether they need the borrow
            lines.append(f"  {_place(i)}: {terms}<0, 10+{terms}={diff + 10}")
        else:
            lines.append(f"  {_place(i)}: {terms}={diff}")
        a, b, i = a // 10, b // 10, i + 1
    return lines


def _multiply_digit(a: int, d: int) -> list[str]:
    """a * d for one digit d in columns, lowest place first: each line multiplies one digit
    and adds the carry; the highest place writes its whole value."""
    lines, carry, i = [], 0, 0
    while a:
        x, total = a % 10, (a % 10) * d + carry
        terms = f"{x}*{d}" + (f"+{carry}" if carry else "")
        note = f", write {total % 10} carry {total // 10}" if total >= 10 and a >= 10 else ""
        lines.append(f"  {_place(i)}: {terms}={total}{note}")
        a, carry, i = a // 10, total // 10, i + 1
    return lines


def _multiply(a: int, b: int) -> list[str]:
    """a * b (non-negative, both at least 2, one of them multi-digit) in columns when one
    factor is a single digit; otherwise as partial products by the digits of the shorter
    operand, each worked in columns and shifted by its place, then summed in columns."""
    long, short = (a, b) if len(str(a)) >= len(str(b)) else (b, a)
    if short < 10:
        return [f"  {long} * {short} in columns:", *_multiply_digit(long, short)]
    parts = [f"{long} * {int(c) * 10**i}" for i, c in enumerate(reversed(str(short))) if c != "0"]
    split = f" = {' + '.join(parts)}," if len(parts) > 1 else ""  # the factors to copy below
    lines, total = [f"  {a} * {b}{split} by partial products:"], None
    for i, c in enumerate(reversed(str(short))):
        d, scale = int(c), 10**i
        if d == 0:
            continue
        partial = long * d * scale
        if d > 1:
            lines += [f"  {long} * {d} in columns:", *_multiply_digit(long, d)]
            lines.append(f"  {long} * {d} = {long * d}")
        if scale > 1:
            shifted = f" = {long * d} * {scale}" if d > 1 else ""
            lines.append(f"  {long} * {d * scale}{shifted} = {partial}")
        if total is not None:
            lines += [f"  {total} + {partial} in columns:", *_column_add(total, partial)]
            lines.append(f"  {total} + {partial} = {total + partial}")
            total += partial
        else:
            total = partial
    return lines


def _show(n: int) -> str:
    return f"({n})" if n < 0 else str(n)


def _step(op: str, a: int, b: int) -> list[str]:
    """The trace lines of one operation: the working, then the result. Single digits get a
    column line too, so every fact is written the way the long operations write theirs."""
    result = evaluate([op, a, b])
    head = f"{_show(a)} {op} {_show(b)}"
    x, y = abs(a), abs(b)
    if op == "*":
        magnitudes = f"{x} * {y}"
        if max(x, y) >= 10 and min(x, y) >= 2:
            work = _multiply(x, y)
        else:
            work = [f"  ones: {x}*{y}={x * y}"] if max(x, y) < 10 else []
    else:
        adds = (op == "+") == ((a < 0) == (b < 0))  # the magnitudes add up
        big, small = (x, y) if adds else (max(x, y), min(x, y))
        sign = "+" if adds else "-"
        magnitudes = f"{big} {sign} {small}"
        if max(x, y) >= 10 and min(x, y) >= 1:
            columns = _column_add(big, small) if adds else _column_sub(big, small)
            work = [f"  {magnitudes} in columns:", *columns]
        else:
            work = [f"  ones: {big}{sign}{small}={abs(result)}"] if big < 10 else []
    if work and head != magnitudes:
        work.insert(0, f"  {head} = " + (f"-({magnitudes})" if result < 0 else magnitudes))
    return [*work, f"{head} = {result}"]


def _next_operation(tree: list[Any]) -> list[Any]:
    """The operation that innermost-first order evaluates next: the leftmost whose operands
    are both numbers."""
    for child in tree[1:]:
        if isinstance(child, list):
            return _next_operation(child)
    return tree


def _reduce(tree: Tree, done: list[Any], value: int) -> Tree:
    if tree is done:
        return value
    if isinstance(tree, int):
        return tree
    return [tree[0], _reduce(tree[1], done, value), _reduce(tree[2], done, value)]


def _trace(tree: Tree) -> list[str]:
    """One operation at a time, each followed by what is left of the expression, so the
    next operation and the moment to stop are read off the line above, not counted."""
    lines = []
    while isinstance(tree, list):
        op, a, b = operation = _next_operation(tree)
        value = evaluate(operation)
        lines += _step(op, a, b)
        tree = _reduce(tree, operation, value)
        lines.append(f"Left: {tree if isinstance(tree, int) else render(tree, grouped=True)}")
    return lines


def score(task: Task, completion: str) -> Verdict:
    """Full marks when the last integer after the reasoning is the value: reasoning is not
    an answer, and a final answer may follow working ("... so 3 * 4 = 12. The answer is 12.")."""
    _, content = split_reasoning(completion)
    if not content.strip():
        return Verdict(0.0, "empty")
    got = final_integer(content)
    expected = task.data["answer"]
    if got is None:
        return Verdict(0.0, "no integer in the answer")
    if got != expected:
        return Verdict(0.0, f"wrong: got {got}, expected {expected}")
    return Verdict(1.0, "correct")


def chain_coverage(task: Task, completion: str) -> float:
    """The share of the worked result lines ("a op b = r", one an operation, innermost
    first) that the completion writes in order: a complete chain of reasoning, which the
    verifier's final-answer check cannot see (a right guess, or a chain that stops early and
    jumps to a number)."""
    results = [line for line in _trace(task.data["tree"]) if line[:1] not in (" ", "L")]
    found, at = 0, 0
    for line in results:
        index = completion.find(line, at)
        if index >= 0:
            found, at = found + 1, index + len(line)
    return found / len(results)


class MathEpisode(SingleAnswerEpisode):
    def score(self, completion: str) -> Verdict:
        return score(self.task, completion)


class MathDomain(Domain):
    name = "math"
    checks_working = True

    def generate(self, seed: int, difficulty: int) -> Task:
        if not MIN_DIFFICULTY <= difficulty <= MAX_DIFFICULTY:
            raise ValueError(f"difficulty must be in {MIN_DIFFICULTY}..{MAX_DIFFICULTY}")
        rng = random.Random(f"math:{seed}:{difficulty}")
        min_ops, max_ops, max_digits, factor_digits = LEVELS[difficulty]
        while True:
            tree = _build(rng, rng.randint(min_ops, max_ops), max_digits, factor_digits)
            # An answer that is also an operand would reward echoing the question.
            if evaluate(tree) not in operands(tree) and len(_trace(tree)) <= TRACE_LINES:
                break
        expression = render(tree)
        prompt = rng.choice(PROMPTS).format(expr=expression)
        data = {"expression": expression, "tree": tree, "answer": evaluate(tree)}
        return Task(self.name, seed, difficulty, prompt, data)

    def reference(self, task: Task, style: Style) -> list[str]:
        answer = task.data["answer"]
        # The expression restated in symbols first: a request in words ("subtract 19 from
        # 100") is then worked from the line above, like any other.
        lines = [f"Work out {task.data['expression']} innermost first, one operation at a time."]
        grouped = render(task.data["tree"], grouped=True)
        if grouped != task.data["expression"]:
            lines.append(f"Products first: {grouped}")
        lines += _trace(task.data["tree"])
        if style == "think":
            lines.append(f"So {task.data['expression']} = {answer}.")
        return [reasoning_block("\n".join(lines)) + str(answer)]

    def reasons(self, style: Style) -> bool:
        """The short style keeps the column working too: without it a small model adds and
        multiplies multi-digit numbers in one step, and gets them wrong (a highspeed model
        trained on bare answers completed almost none of held-out math)."""
        return True

    def start(self, task: Task) -> Episode:
        return MathEpisode(task)

    def first_error(self, task: Task, completion: str) -> tuple[int, int] | None:
        return first_false_line(task, completion)
