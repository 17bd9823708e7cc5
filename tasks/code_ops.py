"""The operation grammar of the code domain: what a task's chain is made of.

Kept apart from `tasks.code`, which holds the domain, the prompt building, the
sandbox harness and the verifier, so that operations can be added (each a phrase, a
reference expression, the types it takes and gives and the inputs that exercise it)
without touching the code that checks answers. `draw_chain` composes operations into a
type-compatible chain and `apply_chain` evaluates one here, in the trusted process.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORDS = ("apple", "Banana", "sky", "Echo", "quiz", "tree", "Ocean", "map", "idea", "rhythm")
EDGE_CASES: dict[str, list[Any]] = {
    "int": [0, -1, 7],
    "str": ["", "a", "Hello World"],
    "list": [[], [0], [-3, -3, 7, 0]],
}


def _int(rng: random.Random) -> int:
    return rng.randint(-1000, 1000)


def _big_int(rng: random.Random) -> int:
    """Wider ints for the digit operations, which are dull on small numbers."""
    return rng.randint(-(10**7), 10**7)


def _str(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, 4))]
    return " ".join(w.swapcase() if rng.random() < 0.2 else w for w in words)


def _list(rng: random.Random) -> list[int]:
    return [rng.randint(-20, 20) for _ in range(rng.randint(0, 8))]


INPUTS: dict[str, Callable[[random.Random], Any]] = {"int": _int, "str": _str, "list": _list}


@dataclass(frozen=True)
class Op:
    """One primitive: a noun phrase and a Python expression over `{x}` (and a constant `{k}`
    drawn from `k` when the op has one), the types it takes and gives, the generator of
    inputs that exercise it (its input type's when None), and a family: a chain never puts
    two ops of one family in a row, since the second would undo or repeat the first
    (sorting a sorted list, upper-casing a lower-cased string)."""

    name: str
    phrase: str
    expr: str
    takes: str
    gives: str
    k: tuple[int, int] | None = None
    inputs: Callable[[random.Random], Any] | None = None
    family: str = ""

    def render(self, template: str, x: str, k: int | None) -> str:
        return template.replace("{x}", x).replace("{k}", str(k))

    def draw_input(self, rng: random.Random) -> Any:
        return (self.inputs or INPUTS[self.takes])(rng)


VOWELS = "'aeiouAEIOU'"
OPS: tuple[Op, ...] = (
    # list -> int
    Op("list_sum", "the sum of {x}", "sum({x})", "list", "int"),
    Op("list_len", "the number of elements in {x}", "len({x})", "list", "int"),
    Op("list_max", "the largest number in {x} (0 if {x} is empty)",
       "max({x}, default=0)", "list", "int"),
    Op("list_min", "the smallest number in {x} (0 if {x} is empty)",
       "min({x}, default=0)", "list", "int"),
    Op("count_even", "how many numbers in {x} are even",
       "sum(1 for v in {x} if v % 2 == 0)", "list", "int"),
    Op("count_negative", "how many numbers in {x} are negative",
       "sum(1 for v in {x} if v < 0)", "list", "int"),
    Op("count_above", "how many numbers in {x} are greater than {k}",
       "sum(1 for v in {x} if v > {k})", "list", "int", (-5, 5)),
    Op("list_first", "the first number in {x} (0 if {x} is empty)",
       "{x}[0] if {x} else 0", "list", "int"),
    Op("list_last", "the last number in {x} (0 if {x} is empty)",
       "{x}[-1] if {x} else 0", "list", "int"),
    Op("count_distinct", "the number of distinct values in {x}", "len(set({x}))", "list", "int"),
    Op("list_spread", "the largest minus the smallest number in {x} (0 if {x} is empty)",
       "max({x}) - min({x}) if {x} else 0", "list", "int"),
    # list -> list
    Op("sort_up", "{x} sorted in ascending order", "sorted({x})", "list", "list",
       family="order"),
    Op("sort_down", "{x} sorted in descending order", "sorted({x}, reverse=True)", "list", "list",
       family="order"),
    Op("list_reverse", "{x} in reverse order", "{x}[::-1]", "list", "list", family="order"),
    Op("keep_even", "the even numbers in {x}, in order",
       "[v for v in {x} if v % 2 == 0]", "list", "list"),
    Op("keep_odd", "the odd numbers in {x}, in order",
       "[v for v in {x} if v % 2 != 0]", "list", "list"),
    Op("keep_positive", "the positive numbers in {x}, in order",
       "[v for v in {x} if v > 0]", "list", "list"),
    Op("each_times", "{x} with each number multiplied by {k}",
       "[v * {k} for v in {x}]", "list", "list", (2, 5)),
    Op("each_plus", "{x} with {k} added to each number",
       "[v + {k} for v in {x}]", "list", "list", (1, 9)),
    Op("each_squared", "{x} with each number squared", "[v * v for v in {x}]", "list", "list"),
    Op("each_abs", "{x} with each number replaced by its absolute value",
       "[abs(v) for v in {x}]", "list", "list"),
    Op("dedupe", "{x} without repeated values, keeping the first occurrence of each",
       "list(dict.fromkeys({x}))", "list", "list"),
    Op("drop_first", "{x} without its first element (empty if {x} is empty)",
       "{x}[1:]", "list", "list"),
    Op("running_total", "the running totals of {x} (item i is the sum of the first i + 1 numbers)",
       "[sum({x}[: i + 1]) for i in range(len({x}))]", "list", "list"),
    Op("take_first", "the first {k} elements of {x} (all of them if there are fewer)",
       "{x}[:{k}]", "list", "list", (1, 4)),
    # list -> str
    Op("join_commas", "the numbers in {x} joined by commas, with no spaces",
       "','.join(str(v) for v in {x})", "list", "str"),
    # int -> int
    Op("int_plus", "{x} plus {k}", "{x} + {k}", "int", "int", (1, 20)),
    Op("int_times", "{x} times {k}", "{x} * {k}", "int", "int", (2, 9)),
    Op("int_abs", "the absolute value of {x}", "abs({x})", "int", "int"),
    Op("int_square", "{x} squared", "{x} * {x}", "int", "int"),
    Op("int_negate", "{x} with its sign flipped", "-{x}", "int", "int"),
    Op("int_mod", "the remainder of {x} divided by {k} (as Python's % gives it)",
       "{x} % {k}", "int", "int", (2, 9)),
    Op("digit_sum", "the sum of the decimal digits of {x} (ignoring its sign)",
       "sum(int(c) for c in str(abs({x})))", "int", "int", inputs=_big_int),
    Op("digit_count", "the number of decimal digits of {x} (ignoring its sign)",
       "len(str(abs({x})))", "int", "int", inputs=_big_int),
    # int -> list, int -> str
    Op("digits", "the decimal digits of {x} as a list of integers (ignoring its sign)",
       "[int(c) for c in str(abs({x}))]", "int", "list", inputs=_big_int),
    Op("int_str", "{x} written in decimal as a string", "str({x})", "int", "str"),
    Op("binary", "the binary digits of the absolute value of {x} as a string, with no prefix",
       "bin(abs({x}))[2:]", "int", "str"),
    # str -> int
    Op("str_len", "the number of characters in {x}", "len({x})", "str", "int"),
    Op("count_vowels", "the number of vowels (a, e, i, o, u in either case) in {x}",
       f"sum(1 for c in {{x}} if c in {VOWELS})", "str", "int"),
    Op("count_upper", "the number of uppercase letters in {x}",
       "sum(1 for c in {x} if c.isupper())", "str", "int"),
    Op("count_words", "the number of words in {x} (separated by whitespace)",
       "len({x}.split())", "str", "int"),
    # str -> str
    Op("str_reverse", "{x} reversed", "{x}[::-1]", "str", "str", family="chars"),
    Op("str_upper", "{x} in upper case", "{x}.upper()", "str", "str", family="case"),
    Op("str_lower", "{x} in lower case", "{x}.lower()", "str", "str", family="case"),
    Op("no_spaces", "{x} with all spaces removed", "{x}.replace(' ', '')", "str", "str"),
    Op("no_vowels", "{x} with all vowels (a, e, i, o, u in either case) removed",
       f"''.join(c for c in {{x}} if c not in {VOWELS})", "str", "str"),
    Op("swap_case", "{x} with the case of every letter swapped", "{x}.swapcase()", "str", "str",
       family="case"),
    Op("sort_chars", "the characters of {x} sorted by code point",
       "''.join(sorted({x}))", "str", "str", family="chars"),
    Op("reverse_words", "the words of {x} in reverse order, joined by single spaces",
       "' '.join({x}.split()[::-1])", "str", "str"),
    Op("str_prefix", "the first {k} characters of {x} (all of it if it is shorter)",
       "{x}[:{k}]", "str", "str", (1, 5)),
    # str -> list
    Op("word_lengths", "the lengths of the words in {x} (separated by whitespace)",
       "[len(w) for w in {x}.split()]", "str", "list"),
    Op("char_codes", "the Unicode code points of the characters in {x}",
       "[ord(c) for c in {x}]", "str", "list"),
)  # fmt: skip
OPS_BY_NAME = {op.name: op for op in OPS}


def apply_chain(chain: list[dict[str, Any]], value: Any) -> Any:
    """Evaluate a chain in this process (trusted: our own expressions) on one input."""
    for step in chain:
        op = OPS_BY_NAME[step["op"]]
        value = eval(op.render(op.expr, "_x", step["k"]), {"_x": value})
    return value


def _same_family(a: Op, b: Op) -> bool:
    return a is b or (a.family != "" and a.family == b.family)


def draw_chain(rng: random.Random, depth: int) -> list[dict[str, Any]]:
    """A random type-compatible chain with no family repeated back to back."""
    op = rng.choice(OPS)
    chain = [op]
    while len(chain) < depth:
        last = chain[-1]
        op = rng.choice([o for o in OPS if o.takes == last.gives and not _same_family(o, last)])
        chain.append(op)
    return [{"op": o.name, "k": rng.randint(*o.k) if o.k else None} for o in chain]
