"""The math working checked line by line: the reference never fails the check, and a slip
of each kind a model makes is found on the line where it happens."""

import pytest

from tasks.math import MathDomain
from tasks.math_working import first_false_line, line_holds

DOMAIN = MathDomain()


@pytest.mark.parametrize("difficulty", [1, 2, 3])
@pytest.mark.parametrize("style", ["think", "short"])
def test_reference_working_holds_on_every_line(difficulty: int, style: str) -> None:
    for seed in range(200):
        task = DOMAIN.generate(seed, difficulty)
        assert first_false_line(task, DOMAIN.reference(task, style)[0]) is None, task


@pytest.mark.parametrize(
    "line, holds",
    [
        ("  ones: 5*8=40, write 0 carry 4", True),
        ("  tens: 2*8+4=22", False),  # a one-digit fact wrong
        ("  ones: 5*8=40, write 4 carry 0", False),  # digit and carry swapped
        ("  ones: 3-5<0, 10+3-5=8", True),
        ("  ones: 5-3<0, 10+5-3=12", False),  # borrowed where nothing was owed
        ("  220 * 53 = 220 * 3 + 220 * 50, by partial products:", True),
        ("  220 * 53 = 220 * 1 + 220 * 50, by partial products:", False),
        ("  220 * 50 = 1100 * 10 = 11000", True),
        ("  12 - 30 = -(30 - 12)", True),
        ("(-3) - 5 = -8", True),
        ("So 25 * 8 * 53 = 10600.", True),
        ("So 25 * 8 * 53 = 11200.", False),
        ("  higher places copy down: 22", True),  # nothing on the line to check
        ("  25 * 8 in columns:", True),
        ("Left: 200 * 53", True),  # worth the answer, 10600
        ("Left: 220 * 53", False),
        ("Products first: (25 * 8) * 53", True),
        ("The answer is ten = 10", True),  # words: not a claim it can check
        # Whatever a sampled answer holds is checked without an error of the checker's own.
        ("  ones: 1\x00=1", True),
        ("  ones: " + "(" * 300 + "1" + ")" * 300 + "=2", True),
        ("  ones: 5*8=40, write " + "9" * 5000 + " carry 1", True),
    ],
)
def test_line_claims(line: str, holds: bool) -> None:
    assert line_holds(line, answer=10600) is holds


def test_the_first_false_line_is_located_in_characters() -> None:
    task = DOMAIN.generate(7, 2)
    reference = DOMAIN.reference(task, "short")[0]
    lines = reference.splitlines(keepends=True)
    # A slip in the first column fact, and a later one: the first is the one blamed.
    first = next(i for i, line in enumerate(lines) if line.startswith("  ") and "=" in line)
    wrong = lines[first].replace("=", "=1", 1)
    later = len(lines) - 3
    slipped = [*lines[:first], wrong, *lines[first + 1 : later], "Left: 1\n", *lines[later:]]
    span = first_false_line(task, "".join(slipped))
    assert span is not None
    assert "".join(slipped)[span[0] : span[1]] == wrong
